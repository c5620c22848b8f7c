package routing

import (
	"fmt"
	"slices"
	"testing"

	"github.com/infernode/infernode/ring"
)

// TestReplicaHeirs: a conversation's heirs (where its replicas go, see kvmove) are the
// node that takes it over if this one fails, and the one after that, never this node or
// one twice.
func TestReplicaHeirs(t *testing.T) {
	c := newCluster(t, "b", "c", "d")
	for i := range 20 {
		key := fmt.Sprint("conv-", i)
		heirs := c.entry.v.heirs(key, 2)
		if len(heirs) != 2 || heirs[0].id == heirs[1].id || heirs[0].id == "a" || heirs[1].id == "a" {
			t.Fatalf("heirs of %q = %v, want two distinct peers", key, heirs)
		}
		// The first heir owns the key once a has gone; the second once the first has too.
		without := func(gone ...string) string {
			var ms []string
			for _, id := range []string{"a", "b", "c", "d"} {
				if !slices.Contains(gone, id) {
					ms = append(ms, id)
				}
			}
			id, _ := ring.New(c.entry.cfg.Ring, ms).Owner(key)
			return id
		}
		if want := without("a"); heirs[0].id != want {
			t.Errorf("first heir of %q = %s, want %s (its owner without a)", key, heirs[0].id, want)
		}
		if want := without("a", heirs[0].id); heirs[1].id != want {
			t.Errorf("second heir of %q = %s, want %s", key, heirs[1].id, want)
		}
	}
}
