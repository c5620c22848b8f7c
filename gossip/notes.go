package gossip

import (
	"encoding/binary"
	"errors"
	"slices"
	"time"

	"github.com/hashicorp/memberlist"
)

// Notes. Besides its tags (memberlist's node metadata: at most MaxTags bytes, carried in
// every message about the member), a node may have a note: a larger blob of the
// application's, at most MaxNote bytes, of which every member keeps the latest version,
// such as routing's digest of the prompt prefixes a node holds. A note spreads as serf
// spreads its user events: a broadcast piggybacked on memberlist's gossip packets (sent
// RetransmitMult x log(N+1) times), relayed once by every member that receives a version
// newer than the one it held, so that it reaches the whole cluster in about as many
// gossip rounds as a membership change; and every push-pull exchange carries every note
// the two members know, which repairs a broadcast lost on the way and teaches a joining
// node the notes sent before it came.
//
// What it costs: a note goes out at most every max(MetaInterval, members/NoteUpdates),
// so the cluster sends NoteUpdates notes a second at most at any size; each is sent by
// every member about RetransmitMult x log(N+1) times (at 1,000 members: 4 x 3 = 12 packets
// of up to MaxNote bytes) and kept by every member (1,000 notes of 512 bytes: half a
// megabyte). A push-pull exchange carries them all (at 1,000 members, about 0.5 MB every
// few minutes, as memberlist stretches the push-pull interval with the cluster's size).

// MaxNote is the most bytes a note may have: a broadcast must fit one gossip packet
// (memberlist's 1,400-byte UDP buffer) beside the sender's name, after encryption's
// overhead and compression, which can grow data that does not compress.
const MaxNote = 640

// noteMsg marks a note in a user message (the first byte: other kinds may follow).
const noteMsg = 1

// note is a member's note as last received.
type note struct {
	version uint64
	body    []byte
}

// SetNote replaces this node's note; Run gossips it as NoteUpdates allows.
func (g *Gossip) SetNote(body []byte) error {
	if len(body) > MaxNote {
		return errors.New("gossip note too large")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.note = slices.Clone(body)
	return nil
}

// Notes are the latest notes of the members alive, by member name, this node's own left
// out. The bodies must not be modified.
func (g *Gossip) Notes() map[string][]byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make(map[string][]byte, len(g.notes))
	for name, n := range g.notes {
		if m, ok := g.members[name]; ok && m.State == Alive && name != g.name {
			out[name] = n.body
		}
	}
	return out
}

// sendNote queues this node's note for broadcast when it changed and is due, since the
// last went out, in a cluster of members.
func (g *Gossip) sendNote(now time.Time, members int) {
	g.mu.Lock()
	mine := g.notes[g.name]
	due := mine == nil || !slices.Equal(g.note, mine.body)
	if since := now.Sub(g.noteSent); since < g.cfg.MetaInterval || since.Seconds() < float64(members)/g.cfg.NoteUpdates {
		due = false
	}
	var msg []byte
	if due {
		n := &note{version: g.noteVersion, body: g.note}
		g.noteVersion++
		g.notes[g.name], g.noteSent = n, now
		msg = encodeNote(nil, g.name, n)
	}
	g.mu.Unlock()
	if msg != nil {
		g.queue.QueueBroadcast(noteBroadcast{name: g.name, msg: append([]byte{noteMsg}, msg...)})
	}
}

// merge keeps a received note when it is newer than the one held for a member this node
// knows; it reports whether it did.
func (g *Gossip) merge(name string, n *note) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, known := g.members[name]; !known || name == g.name {
		return false
	}
	if held := g.notes[name]; held != nil && held.version >= n.version {
		return false
	}
	g.notes[name] = n
	return true
}

// receive handles a note broadcast: kept and relayed when new here.
func (g *Gossip) receive(buf []byte) {
	if len(buf) == 0 || buf[0] != noteMsg {
		return
	}
	name, n, rest, err := decodeNote(buf[1:])
	if err != nil || len(rest) > 0 {
		g.log.Debug("malformed gossip note", "err", err)
		return
	}
	if g.merge(name, n) {
		g.queue.QueueBroadcast(noteBroadcast{name: name, msg: slices.Clone(buf)})
	}
}

// localState is every note this node knows, for a push-pull exchange.
func (g *Gossip) localState() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []byte
	for name, n := range g.notes {
		if _, known := g.members[name]; known || name == g.name {
			out = encodeNote(out, name, n)
		}
	}
	return out
}

// mergeState merges the notes of a push-pull exchange.
func (g *Gossip) mergeState(buf []byte) {
	for len(buf) > 0 {
		name, n, rest, err := decodeNote(buf)
		if err != nil {
			g.log.Debug("malformed gossip notes in push-pull", "err", err)
			return
		}
		g.merge(name, n)
		buf = rest
	}
}

// encodeNote appends a note: the member's name and the body, each length-prefixed, and
// the version.
func encodeNote(out []byte, name string, n *note) []byte {
	out = binary.AppendUvarint(out, uint64(len(name)))
	out = append(out, name...)
	out = binary.BigEndian.AppendUint64(out, n.version)
	out = binary.AppendUvarint(out, uint64(len(n.body)))
	return append(out, n.body...)
}

var errNote = errors.New("malformed note")

// decodeNote reads a note encodeNote wrote from the network: lengths are checked, the
// body is copied.
func decodeNote(buf []byte) (name string, n *note, rest []byte, err error) {
	l, k := binary.Uvarint(buf)
	if k <= 0 || l > 512 || uint64(len(buf)-k) < l+8 {
		return "", nil, nil, errNote
	}
	name, buf = string(buf[k:k+int(l)]), buf[k+int(l):]
	n = &note{version: binary.BigEndian.Uint64(buf)}
	buf = buf[8:]
	if l, k = binary.Uvarint(buf); k <= 0 || l > MaxNote || uint64(len(buf)-k) < l {
		return "", nil, nil, errNote
	}
	n.body = slices.Clone(buf[k : k+int(l)])
	return name, n, buf[k+int(l):], nil
}

// noteBroadcast is a note in memberlist's broadcast queue: a newer note of the same
// member replaces it there.
type noteBroadcast struct {
	name string
	msg  []byte
}

var _ memberlist.NamedBroadcast = noteBroadcast{}

func (b noteBroadcast) Name() string    { return "note " + b.name }
func (b noteBroadcast) Message() []byte { return b.msg }
func (b noteBroadcast) Finished()       {}
func (b noteBroadcast) Invalidates(o memberlist.Broadcast) bool {
	nb, ok := o.(memberlist.NamedBroadcast)
	return ok && nb.Name() == b.Name()
}
