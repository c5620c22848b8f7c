package node

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/internal/conffile"
	"github.com/infernode/infernode/node/quota"
)

// Tenants are who the operator says: an API key names its tenant (Config.KeyFile), and
// the one key of --api-key names the default tenant, whose conversation keys are those of
// earlier versions (an upgrade keeps their caches warm). A request's `user` only subdivides
// its tenant's conversations. A tenant's conversation keys, and the prefix-sharing domain of
// its requests, are its own: no tenant reuses, counts or times another's cached tokens.

// tenant is who a request comes from. The zero value is the default tenant.
type tenant struct{ name string }

// tenantName is what a key file may call a tenant.
var tenantName = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// minKeyLen is the shortest API key a key file may hold.
const minKeyLen = 16

// keyring is the key file's keys, by SHA-256: a lookup by the hash of what a client
// presents takes the same time whichever key it is close to.
type keyring map[[32]byte]string

// loadKeys reads a key file: one "KEY TENANT" a line, blank lines and # comments allowed.
func loadKeys(path string) (keyring, error) {
	keys := keyring{}
	err := conffile.Read("key file", path, func(_ int, f []string) error {
		switch {
		case len(f) != 2:
			return errors.New("want KEY TENANT")
		case len(f[0]) < minKeyLen:
			return fmt.Errorf("keys must be at least %d bytes", minKeyLen)
		case !tenantName.MatchString(f[1]):
			return fmt.Errorf("tenant %q: names are 1-64 of A-Z a-z 0-9 . _ -", f[1])
		}
		h := sha256.Sum256([]byte(f[0]))
		if _, dup := keys[h]; dup {
			return errors.New("a key listed twice")
		}
		keys[h] = f[1]
		return nil
	})
	return keys, err
}

// ReloadKeys reads the key file again (on SIGHUP): requests from then on are checked
// against the new keys. On an error the keys in force stay.
func (s *Server) ReloadKeys() error {
	if s.cfg.KeyFile == "" {
		return s.reloadLimits()
	}
	keys, err := loadKeys(s.cfg.KeyFile)
	if err != nil {
		return err
	}
	s.keys.Store(&keys)
	s.log.Info("keys reloaded", "keys", len(keys))
	return s.reloadLimits()
}

// reloadLimits reads the limits file again; on an error the limits in force stay.
func (s *Server) reloadLimits() error {
	if s.cfg.LimitsFile == "" {
		return nil
	}
	limits, err := quota.Load(s.cfg.LimitsFile)
	if err != nil {
		return err
	}
	s.cluster.Quota().SetLimits(limits)
	s.log.Info("limits reloaded", "lines", len(limits))
	return nil
}

// name is the tenant's name in limits and metrics ("default" for the default tenant).
func (t tenant) limitName() string {
	if t.name == "" {
		return "default"
	}
	return t.name
}

// bearer is the token a request presents, if any.
func bearer(ctx *fasthttp.RequestCtx) ([]byte, bool) {
	return bytes.CutPrefix(ctx.Request.Header.Peek("Authorization"), []byte("Bearer "))
}

// client says which tenant a request to the API comes from, or false when its key is
// missing or wrong. A node with no keys at all is open: everyone is the default tenant.
func (s *Server) client(ctx *fasthttp.RequestCtx) (tenant, bool) {
	keys := *s.keys.Load()
	if s.cfg.APIKey == "" && len(keys) == 0 {
		return tenant{}, true
	}
	got, ok := bearer(ctx)
	if !ok {
		return tenant{}, false
	}
	if s.cfg.APIKey != "" && subtle.ConstantTimeCompare(got, []byte(s.cfg.APIKey)) == 1 {
		return tenant{}, true
	}
	name, ok := keys[sha256.Sum256(got)]
	return tenant{name}, ok
}

// operator says whether a request may use the operator's endpoints: with an admin key,
// only that key; without one, as before tenants, the default tenant's key (or anyone on a
// node with no keys). A tenant's key from the key file never may.
func (s *Server) operator(ctx *fasthttp.RequestCtx) bool {
	got, ok := bearer(ctx)
	switch {
	case s.cfg.AdminKey != "":
		return ok && subtle.ConstantTimeCompare(got, []byte(s.cfg.AdminKey)) == 1
	case s.cfg.APIKey != "":
		return ok && subtle.ConstantTimeCompare(got, []byte(s.cfg.APIKey)) == 1
	}
	return len(*s.keys.Load()) == 0
}

// principal names who is asking, for namespacing conversation keys: a hash of the
// tenant (for the default tenant, the API key, as before tenants) and the request's user
// field. Two principals never share a conversation's slot.
func (t tenant) principal(apiKey, user string) string {
	id := apiKey
	if t.name != "" {
		id = "\x00tenant\x00" + t.name // no API key holds a NUL
	}
	return principal(id, user)
}

// share is the prefix-sharing domain of a tenant's request with cache salt salt: its
// tenant, and its salt within it. The default tenant without a salt has the domain
// earlier versions had.
func (t tenant) share(salt string) string {
	if t.name == "" && salt == "" {
		return ""
	}
	h := sha256.Sum256([]byte(t.name + "\x00" + salt))
	return "t:" + t.name + ":" + hex.EncodeToString(h[:8])
}
