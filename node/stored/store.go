package stored

import (
	"container/list"
	"errors"
	"sync"
	"time"
)

// Record is one stored response, opaque to this package but for its ids.
type Record struct {
	ID string `json:"id"`
	// Items are the ids of the items the record holds that an item reference may name.
	Items []string `json:"items,omitempty"`
	// Expires is when the record is dropped, in Unix milliseconds.
	Expires int64 `json:"expires"`
	// Body is the response and the conversation it ends (node's format).
	Body []byte `json:"body"`
}

func (r Record) size() int64 {
	n := int64(len(r.ID) + len(r.Body) + 64)
	for _, id := range r.Items {
		n += int64(len(id) + 16)
	}
	return n
}

// ErrTooLarge: a record larger than MaxRecordBytes, or than the store's bound.
var ErrTooLarge = errors.New("stored response too large")

// MaxRecordBytes bounds one record: a conversation's history is bounded by a context far
// smaller than this, and a record crosses the hop in one request body.
const MaxRecordBytes = 1 << 20

// Store is this node's stored responses by conversation, bounded in bytes (the least
// recently used go first) and by each record's expiry. It is safe for concurrent use.
type Store struct {
	max int64
	now func() time.Time

	mu    sync.Mutex
	convs map[string]*conv
	lru   list.List // *entry, most recently used at the front
	bytes int64
	swept time.Time
	// evicted counts records dropped for room, and expired those dropped for age.
	evicted, expired int
}

type conv struct {
	recs  map[string]*entry
	items map[string]string // item id → record id
}

type entry struct {
	key  string
	rec  Record
	size int64
	elem *list.Element
}

// NewStore returns a store of at most max bytes; now is its clock.
func NewStore(max int64, now func() time.Time) *Store {
	return &Store{max: max, now: now, convs: map[string]*conv{}}
}

// Put stores rec in key's conversation, replacing a record of the same id.
func (s *Store) Put(key string, rec Record) error {
	size := rec.size()
	if size > MaxRecordBytes || size > s.max {
		return ErrTooLarge
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if rec.Expires <= now.UnixMilli() {
		return nil // already expired: a late copy
	}
	if now.Sub(s.swept) > time.Minute {
		s.sweep(now)
	}
	if old := s.convs[key]; old != nil && old.recs[rec.ID] != nil {
		s.remove(old.recs[rec.ID])
	}
	c := s.convs[key]
	if c == nil {
		c = &conv{recs: map[string]*entry{}, items: map[string]string{}}
		s.convs[key] = c
	}
	e := &entry{key: key, rec: rec, size: size}
	e.elem = s.lru.PushFront(e)
	c.recs[rec.ID] = e
	for _, id := range rec.Items {
		c.items[id] = rec.ID
	}
	s.bytes += size
	for s.bytes > s.max {
		s.remove(s.lru.Back().Value.(*entry))
		s.evicted++
	}
	return nil
}

// Get returns the record of key's conversation whose id, or one of whose items' ids, is
// id.
func (s *Store) Get(key, id string) (Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.convs[key]
	if c == nil {
		return Record{}, false
	}
	e := c.recs[id]
	if e == nil {
		e = c.recs[c.items[id]]
	}
	if e == nil {
		return Record{}, false
	}
	if e.rec.Expires <= s.now().UnixMilli() {
		s.remove(e)
		s.expired++
		return Record{}, false
	}
	s.lru.MoveToFront(e.elem)
	return e.rec, true
}

// Delete drops the record id of key's conversation, reporting whether it was held.
func (s *Store) Delete(key, id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.convs[key]
	if c == nil || c.recs[id] == nil {
		return false
	}
	s.remove(c.recs[id])
	return true
}

// Conversations lists the conversations with records here.
func (s *Store) Conversations() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.convs))
	for k := range s.convs {
		out = append(out, k)
	}
	return out
}

// Records are the live records of key's conversation.
func (s *Store) Records(key string) []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now().UnixMilli()
	var out []Record
	for _, e := range s.convs[key].recsOrNil() {
		if e.rec.Expires > now {
			out = append(out, e.rec)
		}
	}
	return out
}

func (c *conv) recsOrNil() map[string]*entry {
	if c == nil {
		return nil
	}
	return c.recs
}

// Stats are the records held, their bytes, and how many were dropped for room and for age.
func (s *Store) Stats() (records int, bytes int64, evicted, expired int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lru.Len(), s.bytes, s.evicted, s.expired
}

// sweep drops every expired record. Callers hold mu.
func (s *Store) sweep(now time.Time) {
	s.swept = now
	for el := s.lru.Front(); el != nil; {
		next := el.Next()
		if e := el.Value.(*entry); e.rec.Expires <= now.UnixMilli() {
			s.remove(e)
			s.expired++
		}
		el = next
	}
}

// remove drops e. Callers hold mu.
func (s *Store) remove(e *entry) {
	s.lru.Remove(e.elem)
	s.bytes -= e.size
	c := s.convs[e.key]
	delete(c.recs, e.rec.ID)
	for _, id := range e.rec.Items {
		if c.items[id] == e.rec.ID {
			delete(c.items, id)
		}
	}
	if len(c.recs) == 0 {
		delete(s.convs, e.key)
	}
}
