package routing

import (
	"net"
	"testing"
)

// FuzzMeta: whatever a peer gossips, the schema decodes, validates and classifies it
// without panicking, and tags it accepts name a plain host:port.
func FuzzMeta(f *testing.F) {
	f.Add("a#1", []byte(`{"id":"a","http":"127.0.0.1:8080","fp":"fp","model":"m","ready":true,"run":1,"wait":2,"kvfree":3,"qcap":4,"pf":5,"tps":6,"hop":[1],"hopv":4,"slow":["b"]}`))
	f.Add("a#1", []byte(`{"id":"a","http":"[::1]:80","leaving":true}`))
	f.Add("a#1", []byte(`{"id":"a","http":"10.0.0.5:80/admin?x="}`))
	f.Add("b", []byte(`{"id":"b","http":"h:1","hop":[-1,99999999999],"slow":null}`))
	f.Add("", []byte(`null`))
	f.Fuzz(func(t *testing.T, name string, tags []byte) {
		err := Schema.Validate(name, tags)
		Schema.Leaving(tags)
		Schema.Urgent(tags, Schema.Leave(tags))
		if err != nil {
			return
		}
		m, err := DecodeMeta(tags)
		if err != nil {
			t.Fatalf("valid tags do not decode: %v", err)
		}
		if _, _, err := net.SplitHostPort(m.HTTPAddr); err != nil {
			t.Fatalf("accepted an HTTP address %q that is not host:port", m.HTTPAddr)
		}
	})
}
