package stored

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/internal/validate"
	"github.com/infernode/infernode/node/hop"
)

// Config configures stored responses. Build one with DefaultConfig.
type Config struct {
	// MaxBytes bounds the records this node keeps; past it the least recently used go.
	// Default 64 MiB.
	MaxBytes int64
	// TTL is how long a response stays stored. Default 24h.
	TTL time.Duration
	// Replicas is how many nodes besides the owner keep a copy: those that would take the
	// conversation over, as for its KV (routing sets it to the KV's). Default 1.
	Replicas int
	// Logger receives the keeper's logs. Nil means slog.Default().
	Logger *slog.Logger
}

// DefaultConfig returns infernode's stored-response settings.
func DefaultConfig() Config {
	return Config{MaxBytes: 64 << 20, TTL: 24 * time.Hour, Replicas: 1}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	p.Check(c.MaxBytes >= MaxRecordBytes, "stored responses' bytes must be at least %d, got %d", MaxRecordBytes, c.MaxBytes)
	p.Positive("stored responses' TTL", c.TTL)
	p.Check(c.Replicas >= 0, "stored responses' replicas must not be negative, got %d", c.Replicas)
	return p.Err()
}

// Peer is a node that may keep records.
type Peer struct {
	ID, Addr string
	Minor    int // the hop minor version it gossips
}

// Ring is what a keeper needs of the cluster, as this node sees it; routing's view
// implements it. Its methods are safe for concurrent use and do not block.
type Ring interface {
	// Owners are up to n nodes in the order requests for key try them, this node
	// included (its Peer has the Self id).
	Owners(key string, n int) []Peer
	// Heirs are up to n other members that would own key in turn once this node is gone.
	Heirs(key string, n int) []Peer
	// Self is this node's id.
	Self() string
}

// ErrNotFound: no node asked holds the record.
var ErrNotFound = errors.New("stored response not found")

// Keeper stores records on the nodes that keep their conversations, and serves their hops.
type Keeper struct {
	cfg    Config
	log    *slog.Logger
	store  *Store
	ring   Ring // nil: a node without peers
	hop    *hop.Auth
	client *http.Client
	now    func() time.Time

	ops *prometheus.CounterVec
}

// New builds a keeper. A nil ring keeps everything here (a node without peers).
func New(cfg Config, ring Ring, auth *hop.Auth, client *http.Client, now func() time.Time) (*Keeper, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	k := &Keeper{cfg: cfg, log: log.With("component", "stored"), store: NewStore(cfg.MaxBytes, now), ring: ring,
		hop: auth, client: client, now: now,
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_stored_ops_total", Help: "Stored-response operations this node made on peers, by operation and outcome.",
		}, []string{"op", "outcome"}),
	}
	return k, nil
}

// Collectors are the keeper's metrics.
func (k *Keeper) Collectors() []prometheus.Collector {
	stat := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f)
	}
	return []prometheus.Collector{k.ops,
		stat("infernode_stored_responses", "Stored responses kept on this node.", func() float64 {
			n, _, _, _ := k.store.Stats()
			return float64(n)
		}),
		stat("infernode_stored_response_bytes", "Bytes of stored responses kept on this node.", func() float64 {
			_, b, _, _ := k.store.Stats()
			return float64(b)
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "infernode_stored_evictions_total",
			Help: "Stored responses dropped for room (before their TTL)."}, func() float64 {
			_, _, e, _ := k.store.Stats()
			return float64(e)
		}),
	}
}

// Expiry is when a record stored now expires, in Unix milliseconds.
func (k *Keeper) Expiry() int64 { return k.now().Add(k.cfg.TTL).UnixMilli() }

// op is a stored-response hop's body.
type op struct {
	Op     string  `json:"op"` // put, get, delete
	Key    string  `json:"key"`
	ID     string  `json:"id,omitempty"`
	Record *Record `json:"record,omitempty"`
	// Spread asks the receiver to apply a put or delete to its heirs too: the node that
	// served a turn copies its record where its KV replicas go.
	Spread bool `json:"spread,omitempty"`
}

// Put stores rec in key's conversation on the node that served its turn (at, "" for
// this one) and that node's heirs. When at cannot take it, the conversation's other
// owners are tried, and in the end this node keeps it: a stored response is never lost
// while the node that answered lives.
func (k *Keeper) Put(ctx context.Context, key string, rec Record, at string) error {
	if rec.size() > MaxRecordBytes {
		return ErrTooLarge
	}
	tried := map[string]bool{}
	for _, p := range k.targets(key, at) {
		if tried[p.ID] {
			continue
		}
		tried[p.ID] = true
		if p.ID == k.self() {
			return k.putHere(ctx, key, rec)
		}
		if _, err := k.send(ctx, p, op{Op: "put", Key: key, Record: &rec, Spread: true}); err != nil {
			k.log.Warn("stored response not kept on the owner, trying the next", "peer", p.ID, "err", err)
			continue
		}
		return nil
	}
	return k.putHere(ctx, key, rec)
}

// putHere keeps rec here and copies it to this node's heirs.
func (k *Keeper) putHere(ctx context.Context, key string, rec Record) error {
	if err := k.store.Put(key, rec); err != nil {
		return err
	}
	k.spread(ctx, op{Op: "put", Key: key, Record: &rec})
	return nil
}

// spread applies o on this node's heirs for its key, best effort: on the first
// Config.Replicas of them that take it (one that fails, dead but still on the ring, is
// passed over for the next). It reports whether any did.
func (k *Keeper) spread(ctx context.Context, o op) (applied bool) {
	if k.ring == nil || k.cfg.Replicas == 0 {
		return false
	}
	done := 0
	for _, p := range k.ring.Heirs(o.Key, k.cfg.Replicas+2) {
		if done == k.cfg.Replicas {
			break
		}
		if _, err := k.send(ctx, p, o); err != nil {
			k.log.Debug("stored response not copied", "op", o.Op, "peer", p.ID, "err", err)
			if errors.Is(err, ErrNotFound) {
				done++ // a delete where there was nothing
			}
			continue
		}
		done++
		applied = true
	}
	return applied
}

// targets are the nodes to keep key's records, in order: at (if set), then its owners.
func (k *Keeper) targets(key, at string) []Peer {
	var out []Peer
	if k.ring != nil {
		out = k.ring.Owners(key, k.cfg.Replicas+2)
	}
	if at == "" {
		at = k.self()
	}
	if i := slices.IndexFunc(out, func(p Peer) bool { return p.ID == at }); i > 0 {
		p := out[i]
		out = slices.Insert(slices.Delete(out, i, i+1), 0, p)
	} else if i < 0 && at == k.self() {
		out = slices.Insert(out, 0, Peer{ID: at})
	}
	return out
}

// Get fetches the record of key's conversation with id (or an item's id): from this
// node, else from the conversation's owners in order.
func (k *Keeper) Get(ctx context.Context, key, id string) (Record, error) {
	if rec, ok := k.store.Get(key, id); ok {
		return rec, nil
	}
	for _, p := range k.others(key) {
		b, err := k.send(ctx, p, op{Op: "get", Key: key, ID: id})
		switch {
		case errors.Is(err, ErrNotFound):
			continue
		case err != nil:
			k.log.Warn("stored response: owner did not answer", "peer", p.ID, "err", err)
			continue
		}
		var rec Record
		if err := json.Unmarshal(b, &rec); err != nil {
			k.log.Warn("stored response: bad answer", "peer", p.ID, "err", err)
			continue
		}
		return rec, nil
	}
	return Record{}, ErrNotFound
}

// Delete drops the record id of key's conversation everywhere it is kept, reporting
// whether any node held it.
func (k *Keeper) Delete(ctx context.Context, key, id string) (bool, error) {
	found := k.store.Delete(key, id)
	found = k.spread(ctx, op{Op: "delete", Key: key, ID: id}) || found
	for _, p := range k.others(key) {
		_, err := k.send(ctx, p, op{Op: "delete", Key: key, ID: id, Spread: true})
		switch {
		case err == nil:
			found = true
		case !errors.Is(err, ErrNotFound):
			return found, err // it may still be there: the client should retry
		}
	}
	return found, nil
}

// others are key's owners besides this node.
func (k *Keeper) others(key string) []Peer {
	if k.ring == nil {
		return nil
	}
	var out []Peer
	for _, p := range k.ring.Owners(key, k.cfg.Replicas+2) {
		if p.ID != k.self() {
			out = append(out, p)
		}
	}
	return out
}

func (k *Keeper) self() string {
	if k.ring == nil {
		return ""
	}
	return k.ring.Self()
}

// HandOff copies every conversation's records kept here to the node that keeps them when
// this one is gone (leaving), or to its owner when that is another node now (a ring
// change), with theirs. Copies here stay until they expire or are evicted.
func (k *Keeper) HandOff(ctx context.Context, leaving bool) (moved int) {
	if k.ring == nil {
		return 0
	}
	for _, key := range k.store.Conversations() {
		if ctx.Err() != nil {
			return moved
		}
		var to []Peer
		if leaving {
			to = k.ring.Heirs(key, 3) // the first that takes them: one may be dead but still on the ring
		} else if o := k.ring.Owners(key, 1); len(o) > 0 && o[0].ID != k.self() {
			to = o
		}
		for _, rec := range k.store.Records(key) {
			for _, p := range to {
				if _, err := k.send(ctx, p, op{Op: "put", Key: key, Record: &rec, Spread: true}); err != nil {
					k.log.Warn("stored response not handed off", "peer", p.ID, "err", err)
					continue
				}
				moved++
				break
			}
		}
	}
	if moved > 0 {
		k.log.Info("stored responses handed off", "leaving", leaving, "records", moved)
	}
	return moved
}

// send makes o on p and returns its answer's body (a get's record).
func (k *Keeper) send(ctx context.Context, p Peer, o op) ([]byte, error) {
	outcome := "ok"
	defer func() { k.ops.WithLabelValues(o.Op, outcome).Inc() }()
	if p.Minor < hop.MinorStored {
		outcome = "incapable"
		return nil, fmt.Errorf("peer %s speaks hop 1.%d, before stored responses", p.ID, p.Minor)
	}
	body, err := json.Marshal(o)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", hop.URL(p.Addr, hop.StoredPath), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	k.hop.Sign(req.Header.Set, "POST", hop.StoredPath, p.ID, body)
	nonce := req.Header.Get(hop.HeaderNonce)
	resp, err := k.client.Do(req)
	if err != nil {
		outcome = "failed"
		return nil, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		outcome = "missing"
		return nil, ErrNotFound
	default:
		outcome = "failed"
		return nil, hop.DecodeError(resp)
	}
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 2*MaxRecordBytes))
	if err != nil {
		outcome = "failed"
		return nil, err
	}
	// A record becomes a conversation's history: only the node asked may have sent it.
	if err := k.hop.VerifyAnswer(resp.Header.Get, hop.StoredPath, p.ID, nonce, answer); err != nil {
		outcome = "failed"
		return nil, err
	}
	return answer, nil
}

// Serve answers a peer's stored-response hop (authenticated by the caller): the status,
// and the body signed with sign for the asker's nonce.
func (k *Keeper) Serve(ctx context.Context, in hop.Inbound, sign func(name, value string)) (int, []byte) {
	var o op
	if err := json.Unmarshal(in.Body, &o); err != nil || o.Key == "" {
		return http.StatusBadRequest, nil
	}
	var answer []byte
	switch o.Op {
	case "put":
		if o.Record == nil {
			return http.StatusBadRequest, nil
		}
		if err := k.store.Put(o.Key, *o.Record); err != nil {
			return http.StatusRequestEntityTooLarge, nil
		}
		if o.Spread {
			k.spread(ctx, op{Op: "put", Key: o.Key, Record: o.Record})
		}
	case "get":
		rec, ok := k.store.Get(o.Key, o.ID)
		if !ok {
			return http.StatusNotFound, nil
		}
		answer, _ = json.Marshal(rec)
	case "delete":
		found := k.store.Delete(o.Key, o.ID)
		if o.Spread {
			k.spread(ctx, op{Op: "delete", Key: o.Key, ID: o.ID})
		}
		if !found {
			return http.StatusNotFound, nil
		}
	default:
		return http.StatusBadRequest, nil
	}
	if answer == nil {
		answer = []byte("{}")
	}
	k.hop.SignAnswer(sign, hop.StoredPath, in.Header(hop.HeaderFrom), in.Header(hop.HeaderNonce), hop.SumOf(answer, false))
	return http.StatusOK, answer
}
