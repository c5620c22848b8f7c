package node

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/infernode/infernode/node/hop"
)

// TestPullOutlastsWriteTimeout: a pull's answer may take longer than an answer's write
// timeout (a long prompt's frame on a slow link): the peer reading it slowly gets it
// whole. With the write timeout on the frame too, it got a cut body.
func TestPullOutlastsWriteTimeout(t *testing.T) {
	nodes := startFakeClusterWith(t, 2, testSecret, func(c *Config) { c.WriteTimeout = 100 * time.Millisecond })
	frame := bytes.Repeat([]byte("kv"), 8<<20) // 16 MB: beyond what the sockets buffer
	nodes[1].engine.frame = frame
	auth := hop.NewAuth("n1", testSecret, nil, time.Now, 30*time.Second)
	body := []byte("conv-1")
	req, _ := http.NewRequest("POST", nodes[1].url+hop.PullPath, bytes.NewReader(body))
	auth.Sign(req.Header.Set, "POST", hop.PullPath, "n2", body)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("pull: status %d", resp.StatusCode)
	}
	var got bytes.Buffer
	for { // 256 KB every 10ms: 25 MB/s, well over a second for the frame
		n, err := io.CopyN(&got, resp.Body, 256<<10)
		if err == io.EOF || n == 0 {
			break
		}
		if err != nil {
			t.Fatalf("after %d of %d bytes: %v", got.Len(), len(frame), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got.Len() != len(frame) || sha256.Sum256(got.Bytes()) != sha256.Sum256(frame) {
		t.Fatalf("got %d bytes of the %d-byte frame", got.Len(), len(frame))
	}
}
