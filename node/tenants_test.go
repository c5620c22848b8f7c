package node

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeKeys(t *testing.T, text string) string {
	path := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestKeyFile: a key file's lines name tenants; malformed ones are refused with the line.
func TestKeyFile(t *testing.T) {
	keys, err := loadKeys(writeKeys(t, "# tenants\nkey-of-tenant-a-0001 alpha\n\nkey-of-tenant-b-0002 beta\n"))
	if err != nil || len(keys) != 2 {
		t.Fatalf("keys %v, %v", keys, err)
	}
	for text, want := range map[string]string{
		"short alpha\n":                                    "at least 16",
		"key-of-tenant-a-0001\n":                           "KEY TENANT",
		"key-of-tenant-a-0001 al/pha\n":                    "names are",
		"key-of-tenant-a-0001 a\nkey-of-tenant-a-0001 b\n": "twice",
	} {
		if _, err := loadKeys(writeKeys(t, text)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error saying %q", text, err, want)
		}
	}
}

// TestTenants: each key is its tenant; a user never crosses tenants (one user name in two
// tenants is two principals), the default tenant's keys are those of before tenants, each
// tenant's requests share only within it (a salt subdivides), and the operator's
// endpoints take only the admin key. A reload adds and removes keys.
func TestTenants(t *testing.T) {
	engine := &fakeEngine{n: 1}
	path := writeKeys(t, "key-of-tenant-a-0001 alpha\nkey-of-tenant-b-0002 beta\n")
	url, srv := startStandalone(t, engine, func(c *Config) { c.APIKey, c.KeyFile, c.AdminKey = "default-key", path, "admin-key" })
	ask := func(key, extra string) (int, string, string) {
		resp := postJSON(t, url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hello"}],"user":"u"`+extra+`}`,
			"Authorization", "Bearer "+key)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return resp.StatusCode, "", ""
		}
		last := engine.last.Load()
		return 200, last.SessionID, last.Share
	}
	_, defKey, defShare := ask("default-key", "")
	_, aKey, aShare := ask("key-of-tenant-a-0001", "")
	_, bKey, bShare := ask("key-of-tenant-b-0002", "")
	_, aSalted, aSaltShare := ask("key-of-tenant-a-0001", `,"cache_salt":"s1"`)
	if defKey != "h:"+principal("default-key", "u")+":"+strings.Split(defKey, ":")[2] || defShare != "" {
		t.Errorf("the default tenant's key %q and domain %q changed from before tenants", defKey, defShare)
	}
	if aKey == bKey || aKey == defKey || aShare == bShare || aShare == "" || bShare == "" {
		t.Errorf("tenants mixed: keys %q %q %q, domains %q %q", defKey, aKey, bKey, aShare, bShare)
	}
	if aSalted != aKey || aSaltShare == aShare {
		t.Errorf("a salt changed the conversation (%q, %q) or not the domain (%q)", aSalted, aKey, aSaltShare)
	}
	if status, _, _ := ask("key-of-nobody-0003", ""); status != 401 {
		t.Errorf("an unknown key: %d", status)
	}
	for key, want := range map[string]int{"admin-key": 200, "key-of-tenant-a-0001": 401, "default-key": 401, "": 401} {
		req, _ := http.NewRequest("GET", url+"/metrics", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("/metrics with %q: %d, want %d", key, resp.StatusCode, want)
		}
	}
	os.WriteFile(path, []byte("key-of-tenant-c-0004 gamma\n"), 0o600)
	if err := srv.ReloadKeys(); err != nil {
		t.Fatal(err)
	}
	if status, _, _ := ask("key-of-tenant-a-0001", ""); status != 401 {
		t.Errorf("a removed key still works: %d", status)
	}
	if status, _, _ := ask("key-of-tenant-c-0004", ""); status != 200 {
		t.Errorf("an added key: %d", status)
	}
	os.WriteFile(path, []byte("broken\n"), 0o600)
	if err := srv.ReloadKeys(); err == nil {
		t.Error("a broken key file was loaded")
	}
	if status, _, _ := ask("key-of-tenant-c-0004", ""); status != 200 {
		t.Errorf("after a failed reload the keys in force changed: %d", status)
	}
}
