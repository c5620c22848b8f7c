package testbed

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLeaveHandsOffKV: an owner sent SIGTERM pushes the conversations it holds to their
// next owners before it exits, so their next turn, entering anywhere, starts from cache
// and says what the old owner said.
func TestLeaveHandsOffKV(t *testing.T) {
	c := startCluster(t, 3)
	entry, victim, other := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	type conv struct {
		msgs []message
		want answer // the next turn, as the old owner answered it
	}
	var convs []conv
	for i := 0; len(convs) < 3 && i < 200; i++ {
		m := []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale ", 20))}, {"user", "begin"}}
		first := chat(t, entry.URL(), m, 1)
		if first.node != victim.ID {
			continue
		}
		first = chat(t, entry.URL(), m, 120)
		m = append(m, message{"assistant", first.text}, message{"user", "go on"})
		want := chat(t, entry.URL(), m, 60)
		if want.node != victim.ID || want.cached == 0 {
			t.Fatalf("the second turn ran on %s with %d cached tokens, want %s with its cache", want.node, want.cached, victim.ID)
		}
		convs = append(convs, conv{m, want})
	}
	if len(convs) < 3 {
		t.Fatalf("only %d conversations of 200 are owned by %s", len(convs), victim.ID)
	}
	if err := victim.signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !victim.wait(30 * time.Second) {
		t.Fatalf("%s still running 30s after SIGTERM", victim.ID)
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(entry, other), 5*time.Second, victim); err != nil {
		t.Fatal(err)
	}
	for i, cv := range convs {
		got := chat(t, other.URL(), cv.msgs, 60)
		switch {
		case got.status != 200 || got.node == victim.ID:
			t.Errorf("conversation %d after the leave: status %d, served by %q", i, got.status, got.node)
		case got.cached == 0:
			t.Errorf("conversation %d resumed cold on %s: 0 of %d prompt tokens cached", i, got.node, got.prompt)
		case got.text != cv.want.text:
			t.Errorf("conversation %d on %s: %q, the old owner said %q", i, got.node, got.text, cv.want.text)
		default:
			t.Logf("conversation %d: on %s with %d of %d prompt tokens cached (the old owner had %d)", i, got.node, got.cached, got.prompt, cv.want.cached)
		}
	}
}
