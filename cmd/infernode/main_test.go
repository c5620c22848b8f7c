package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/node/routing"
)

var binary string

// TestMain builds the infernode binary once; the tests run it as real processes.
func TestMain(m *testing.M) { testenv.RunWithBinary(m, ".", &binary) }

func TestHelpAndBadFlags(t *testing.T) {
	out, err := exec.Command(binary, "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Usage:") || !strings.Contains(string(out), "INFERNODE_") {
		t.Errorf("--help: %v\n%s", err, out)
	}
	cmd := exec.Command(binary)
	cmd.Env = append(os.Environ(), "INFERNODE_MODEL=")
	out, err = cmd.CombinedOutput()
	if code := exitCode(err); code != 2 || !strings.Contains(string(out), "--model is required") {
		t.Errorf("no model: exit %d\n%s", code, out)
	}
	cmd = exec.Command(binary, "--model", "m.gguf")
	cmd.Env = append(os.Environ(), "INFERNODE_LOG_FORMAT=yaml")
	out, err = cmd.CombinedOutput()
	if code := exitCode(err); code != 2 || !strings.Contains(string(out), "--log-format") {
		t.Errorf("bad env value: exit %d\n%s", code, out)
	}
}

func exitCode(err error) int {
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

// process is a running infernode.
type process struct {
	cmd  *exec.Cmd
	url  string
	done chan error
}

// start runs infernode on a free loopback port, configured through the environment as a
// user would, and waits until it is ready.
func start(t *testing.T, args ...string) *process {
	t.Helper()
	model := testenv.Model(t)
	cmd := exec.Command(binary, append([]string{"--log-format", "json"}, args...)...)
	cmd.Env = append(os.Environ(), "INFERNODE_MODEL="+model, "INFERNODE_ADDR=127.0.0.1:0", "INFERNODE_CTX=2048")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{cmd: cmd, done: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "serving" {
				addr <- line.Addr
			}
			t.Log(sc.Text())
		}
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-p.done
	})
	select {
	case a := <-addr:
		p.url = "http://" + a
	case <-time.After(30 * time.Second):
		t.Fatal("infernode did not report its address")
	}
	if !poll.Answers200(p.url+"/readyz", 30*time.Second) {
		t.Fatal("infernode did not become ready")
	}
	return p
}

// openStream starts a streaming completion and returns its body once the first event
// has arrived.
func openStream(t *testing.T, p *process, maxTokens int) *bufio.Reader {
	t.Helper()
	body := fmt.Sprintf(`{"prompt":"the long story","max_tokens":%d,"temperature":0,"stream":true}`, maxTokens)
	resp, err := http.Post(p.url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		t.Fatalf("stream: status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first event %q, %v", line, err)
	}
	return br
}

func TestSIGTERMDrainsStreams(t *testing.T) {
	p := start(t, "--drain-timeout", "30s")
	stream := openStream(t, p, 400)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(stream)
	if err != nil {
		t.Fatalf("stream cut during drain: %v", err)
	}
	if !strings.HasSuffix(string(rest), "data: [DONE]\n\n") || !strings.Contains(string(rest), `"finish_reason":"length"`) {
		t.Errorf("stream did not finish during drain; ends %q", tail(string(rest)))
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v, want 0", err)
		}
		p.done <- err // for Cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("infernode did not exit after its streams finished")
	}
	if _, err := http.Get(p.url + "/healthz"); err == nil {
		t.Error("infernode still accepts connections after exiting")
	}
}

func TestDrainTimeoutEndsStreamsExplicitly(t *testing.T) {
	p := start(t, "--drain-timeout", "300ms")
	stream := openStream(t, p, 2000)
	p.cmd.Process.Signal(syscall.SIGTERM)
	rest, _ := io.ReadAll(stream)
	if !strings.Contains(string(rest), `data: {"error":`) || strings.Contains(string(rest), "[DONE]") {
		t.Errorf("stream canceled by the drain timeout must end with an error event; ends %q", tail(string(rest)))
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("exit: %v, want 0", err)
		}
		p.done <- err
	case <-time.After(30 * time.Second):
		t.Fatal("infernode did not exit after the drain timeout")
	}
}

func tail(s string) string {
	if len(s) > 300 {
		return "..." + s[len(s)-300:]
	}
	return s
}

// TestNetworkFlag: --network wan paces gossip and peer checks for a WAN, keeps a probe
// interval set by hand, and anything but lan or wan is refused.
func TestNetworkFlag(t *testing.T) {
	base := []string{"--model", "m.gguf", "--gossip-addr", "127.0.0.1:7946", "--insecure"}
	o, err := parse(append(base, "--network", "wan"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.gossip.ProbeInterval != gossip.WANConfig().ProbeInterval || o.routing.ProbeInterval != routing.WANConfig().ProbeInterval {
		t.Errorf("--network wan: gossip probes every %v, peer checks every %v", o.gossip.ProbeInterval, o.routing.ProbeInterval)
	}
	if o, err = parse(append(base, "--network", "wan", "--probe-interval", "3s"), io.Discard); err != nil || o.routing.ProbeInterval != 3*time.Second {
		t.Errorf("--probe-interval 3s with --network wan: %v, %v", o.routing.ProbeInterval, err)
	}
	if o, err = parse(base, io.Discard); err != nil || o.gossip.ProbeInterval != gossip.DefaultConfig().ProbeInterval {
		t.Errorf("default network: gossip probes every %v, %v", o.gossip.ProbeInterval, err)
	}
	if _, err := parse(append(base, "--network", "moon"), io.Discard); err == nil || !strings.Contains(err.Error(), "--network") {
		t.Errorf("--network moon: %v", err)
	}
}

// TestQuantizeCommand: the binary writes a Q8_0 copy of the default model that a node
// serves, flags may follow the files, and a bad type or missing file is a clear error that
// writes nothing.
func TestQuantizeCommand(t *testing.T) {
	model := testenv.Model(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "q8.gguf")
	if b, err := exec.Command(binary, "quantize", model, out, "--type", "q8_0").CombinedOutput(); err != nil {
		t.Fatalf("quantize: %v\n%s", err, b)
	}
	for _, c := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"--type", "q3", model, filepath.Join(dir, "x.gguf")}, 2, "unknown type \"q3\""},
		{[]string{filepath.Join(dir, "missing.gguf"), filepath.Join(dir, "x.gguf")}, 1, "no such file"},
		{[]string{model}, 2, "Usage"},
	} {
		b, err := exec.Command(binary, append([]string{"quantize"}, c.args...)...).CombinedOutput()
		if exitCode(err) != c.code || !strings.Contains(string(b), c.says) {
			t.Errorf("quantize %v: %v, want exit %d saying %q:\n%s", c.args, err, c.code, c.says, b)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("files left: %v, want only q8.gguf", entries)
	}
	p := start(t, "--model", out)
	resp, err := http.Post(p.url+"/v1/completions", "application/json",
		strings.NewReader(`{"prompt":"the long story","max_tokens":8,"temperature":0}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Choices []struct{ Text string }
		Usage   struct {
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil || resp.StatusCode != 200 ||
		len(answer.Choices) == 0 || answer.Usage.CompletionTokens != 8 || strings.TrimSpace(answer.Choices[0].Text) == "" {
		t.Errorf("a node on the Q8_0 model answered %d %+v (%v), want 8 tokens of text", resp.StatusCode, answer, err)
	}
}
