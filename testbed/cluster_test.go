package testbed

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
)

var binary string

// TestMain builds infernode once; every test runs it as real processes on loopback.
func TestMain(m *testing.M) { testenv.RunWithBinary(m, "../cmd/infernode", &binary) }

// launch starts cfg's cluster of the test binary, its logs in a temporary directory and
// the tails of them in the test's output if it fails, one llama.cpp thread a node (several
// nodes share this machine's cores) unless cfg.Args says otherwise, and stops it when the
// test ends.
func launch(t testing.TB, cfg Config) *Cluster {
	t.Helper()
	cfg.Binary, cfg.LogDir = binary, t.TempDir()
	// Many of these tests compare one node's text with another's to the byte on the
	// random-weight test model, so every pool must be laid out as the others': with idle
	// conversations moved to host memory around each turn (--kv-host) an old owner's
	// answer differed at one of the model's near-ties (" big" five times, not four) while
	// the new owner, cold or from the old owner's own cache, agreed with itself. The
	// moves' exactness is TestHostKVMatchesUninterrupted's (session, on a pretrained
	// model); the chaos suites run with them, their checker bounding near-ties.
	cfg.Args = append([]string{"--log-level", "info", "--threads", "1", "--kv-host=false"}, cfg.Args...)
	c, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		if t.Failed() {
			for _, n := range c.Nodes {
				b, _ := os.ReadFile(n.logPath())
				t.Logf("log of %s:\n%s", n.ID, tailLines(string(b), 40))
			}
		}
	})
	return c
}

func startCluster(t testing.TB, n int, args ...string) *Cluster {
	t.Helper()
	c := launch(t, Config{Model: testenv.Model(t), Nodes: n,
		Args: append([]string{"--ctx", "8192"}, args...)})
	if took, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("%d nodes converged in %v", n, took)
	}
	return c
}

// ownedBy probes conversations conv(0), conv(1), ... with a one-token turn entering on
// entry (an idle cluster serves each on its owner) until n of them were served by owner,
// and returns those; it fails the test after tries probes.
func ownedBy(t testing.TB, entry, owner *Node, n, tries int, conv func(i int) []message) [][]message {
	t.Helper()
	var owned [][]message
	for i := 0; len(owned) < n && i < tries; i++ {
		if m := conv(i); chat(t, entry.URL(), m, 1).node == owner.ID {
			owned = append(owned, m)
		}
	}
	if len(owned) < n {
		t.Fatalf("only %d conversations of %d are owned by %s, want %d", len(owned), tries, owner.ID, n)
	}
	return owned
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

type answer struct {
	status int
	node   string
	prompt int    // prompt tokens
	cached int    // of them, reused from the KV cache
	source string // how the cached tokens came to the node (X-Infernode-KV-Source; empty: they did not move)
	hops   string // forwards behind the answer (X-Infernode-Hops)
	text   string
	body   []byte // the whole response
}

var client = &http.Client{Timeout: 60 * time.Second}

// patient is the client of benchmarks whose requests may wait minutes: an 8,000-token
// prefill, a burst of long prompts queued behind each other.
var patient = &http.Client{Timeout: 10 * time.Minute}

func chat(t testing.TB, url string, msgs []message, maxTokens int) answer {
	t.Helper()
	return chatWith(t, url, map[string]any{"messages": msgs, "max_tokens": maxTokens, "temperature": 0})
}

// postChat posts a chat completion's body with an API key and returns its status.
func postChat(t testing.TB, url, key, body string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// chatWith sends a chat completion with any body and reads what the tests look at.
func chatWith(t testing.TB, url string, req map[string]any) answer {
	t.Helper()
	return chatVia(t, client, url, req)
}

// chatVia is chatWith through c.
func chatVia(t testing.TB, c *http.Client, url string, req map[string]any) answer {
	t.Helper()
	body, _ := json.Marshal(req)
	resp, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Errorf("chat: %v", err)
		return answer{}
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct{ Message message }
	}
	b, _ := io.ReadAll(resp.Body)
	json.Unmarshal(b, &out)
	a := answer{status: resp.StatusCode, node: resp.Header.Get("X-Infernode-Node"), body: b}
	a.prompt, _ = strconv.Atoi(resp.Header.Get("X-Infernode-Prompt-Tokens"))
	a.cached, _ = strconv.Atoi(resp.Header.Get("X-Infernode-Cached-Tokens"))
	a.source = resp.Header.Get("X-Infernode-KV-Source")
	a.hops = resp.Header.Get("X-Infernode-Hops")
	if len(out.Choices) > 0 {
		a.text = out.Choices[0].Message.Content
	}
	return a
}

// TestConversationAffinity: every turn of a conversation is served by one node whatever
// node it enters on, and later turns reuse its KV cache.
func TestConversationAffinity(t *testing.T) {
	c := startCluster(t, 3)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	var mu sync.Mutex
	servedBy := map[string]int{}
	var wg sync.WaitGroup
	work := make(chan int)
	for w := range 6 {
		rng := rand.New(rand.NewPCG(seed, uint64(w)))
		wg.Go(func() {
			for conv := range work {
				msgs := []message{{"system", fmt.Sprintf("you are river number %d", conv)}, {"user", "where do you flow"}}
				var node string
				for turn := range 3 {
					entry := c.Nodes[rng.IntN(len(c.Nodes))]
					a := chat(t, entry.URL(), msgs, 8)
					switch {
					case a.status != 200:
						t.Errorf("conversation %d turn %d via %s: status %d", conv, turn, entry.ID, a.status)
					case turn == 0:
						node = a.node
					case a.node != node:
						t.Errorf("conversation %d turn %d via %s served by %s, turn 1 by %s", conv, turn, entry.ID, a.node, node)
					case a.cached == 0:
						t.Errorf("conversation %d turn %d reused no cached tokens", conv, turn)
					}
					msgs = append(msgs, message{"assistant", a.text}, message{"user", fmt.Sprintf("and after %d", turn)})
				}
				mu.Lock()
				servedBy[node]++
				mu.Unlock()
			}
		})
	}
	for conv := range 50 {
		work <- conv
	}
	close(work)
	wg.Wait()
	t.Logf("conversations per node: %v", servedBy)
	if len(servedBy) != 3 {
		t.Errorf("50 conversations landed on %d nodes, want all 3: %v", len(servedBy), servedBy)
	}
}

// TestSharedSystemPrompt: through the real binary, a conversation that begins with the
// system prompt of another served on the same node prefills only the rest (the node's
// shared-prefix counter grows by at least the system prompt), reports none of it as its
// own cache, and answers as a node that never saw the other conversation does.
func TestSharedSystemPrompt(t *testing.T) {
	system := strings.Repeat("you answer questions about the quiet river and the old stone bridge ", 10)
	ask := func(q string) []message { return []message{{"system", system}, {"user", q}} }
	c := startCluster(t, 1)
	n := c.Nodes[0]
	if a := chat(t, n.URL(), ask("where does the river run"), 8); a.status != 200 {
		t.Fatalf("first conversation: status %d", a.status)
	}
	before, err := c.Metric(n, "infernode_shared_prefix_tokens_total")
	if err != nil {
		t.Fatal(err)
	}
	got := chat(t, n.URL(), ask("what lives in the river"), 16)
	after, err := c.Metric(n, "infernode_shared_prefix_tokens_total")
	if err != nil {
		t.Fatal(err)
	}
	if shared := int(after - before); got.status != 200 || got.cached != 0 || shared < 64 || shared >= got.prompt {
		t.Errorf("second conversation: status %d, %d of %d prompt tokens shared, %d cached; want 200, at least 64 shared and not all, none cached",
			got.status, shared, got.prompt, got.cached)
	}
	fresh := startCluster(t, 1)
	if want := chat(t, fresh.Nodes[0].URL(), ask("what lives in the river"), 16); want.text != got.text {
		t.Errorf("on a shared system prompt: %q; on a node that never saw it: %q", got.text, want.text)
	}

	// A burst with a system prompt new to the node: prefilled once, 64 tokens a step, and
	// every answer as the other node gives it, asked one at a time.
	burst := startCluster(t, 1, "--batch", "64")
	b := burst.Nodes[0]
	system = strings.Repeat("you answer questions about the long grey road and the tall green hill ", 10)
	questions := []string{"where does the road go", "who walks on it", "what is on the hill", "is it far"}
	answers := make([]answer, len(questions))
	var wg sync.WaitGroup
	for i, q := range questions {
		wg.Go(func() { answers[i] = chat(t, b.URL(), ask(q), 8) })
	}
	wg.Wait()
	shared, err := burst.Metric(b, "infernode_shared_prefix_tokens_total")
	if err != nil {
		t.Fatal(err)
	}
	prompts, shortest := 0, answers[0].prompt
	for i, a := range answers {
		prompts, shortest = prompts+a.prompt, min(shortest, a.prompt)
		if want := chat(t, fresh.Nodes[0].URL(), ask(questions[i]), 8); a.status != 200 || a.text != want.text {
			t.Errorf("%q in a burst: status %d, %q; alone on another node: %q", questions[i], a.status, a.text, want.text)
		}
	}
	// Three of the four take the system prompt's cells (all but the question and the
	// template's last 20 tokens at most), less a step each at most.
	if want := 3 * (shortest - 20 - 64); shared < float64(want) {
		t.Errorf("a burst of %d prompt tokens shared %.0f, want at least %d", prompts, shared, want)
	}
}

// streamChat streams a greedy completion and returns its text, the node that served it
// first, and how many resume markers it carried; kill, if set, runs once after the first
// `after` events.
func streamChat(url string, msgs []message, maxTokens int, after int, kill func()) (string, string, int, error) {
	return streamChatWith(url, map[string]any{"messages": msgs, "max_tokens": maxTokens, "temperature": 0}, after, kill)
}

// streamChatWith is streamChat for any request body (streamed).
func streamChatWith(url string, req map[string]any, after int, kill func()) (string, string, int, error) {
	req["stream"] = true
	body, _ := json.Marshal(req)
	resp, err := client.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		return "", "", 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return "", "", 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	events, done, resumes := 0, false, 0
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), ": infernode-resumed") {
			resumes++
		}
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var ev struct {
			Choices []struct{ Delta message }
			Error   *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return text.String(), "", resumes, err
		}
		if ev.Error != nil {
			return text.String(), "", resumes, fmt.Errorf("error event: %s", ev.Error.Message)
		}
		if len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
		if events++; events == after && kill != nil {
			kill()
		}
	}
	if !done {
		return text.String(), "", resumes, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
	}
	return text.String(), resp.Header.Get("X-Infernode-Node"), resumes, nil
}

// TestKillOwner kills a conversation's owner while it streams: the stream that entered
// elsewhere resumes on the next owner and reads as one answer; the one that entered on the
// dead node fails explicitly; every survivor's ring drops the node in bounded time and
// takes it back after a restart, with its conversations.
func TestKillOwner(t *testing.T) {
	c := startCluster(t, 3)
	// Find a conversation owned by node2.
	victim := c.Nodes[1]
	msgs := ownedBy(t, c.Nodes[0], victim, 1, 100, func(i int) []message {
		return []message{{"system", fmt.Sprintf("story %d", i)}, {"user", "tell me everything"}}
	})[0]
	const long = 1200 // long enough for the kill to land mid-stream; longer answers meet more near-ties (see docs/CHAOS.md)
	reference, served, _, err := streamChat(c.Nodes[0].URL(), msgs, long, 0, nil)
	if err != nil || served != victim.ID {
		t.Fatalf("reference stream: served by %s, %v", served, err)
	}

	// The reference left a replica of the conversation on the victim's heir: the stream
	// resumed there must prefill only what it adds to it, not the answer so far.
	reused := func() float64 {
		sum := 0.0
		for _, n := range []*Node{c.Nodes[0], c.Nodes[2]} {
			v, _ := c.Metric(n, "infernode_reused_prefix_tokens_total")
			sum += v
		}
		return sum
	}
	reusedBefore := reused()

	// Two streams of the same conversation: one entering on node1 (resumable), one
	// entering on the victim itself (it dies with it).
	var wg sync.WaitGroup
	var onVictimErr error
	wg.Go(func() { _, _, _, onVictimErr = streamChat(victim.URL(), msgs, long, 0, nil) })
	survivors := c.IDs(c.Nodes[0], c.Nodes[2])
	detected := make(chan error, 1)
	var detection time.Duration
	resumed, _, markers, err := streamChat(c.Nodes[0].URL(), msgs, long, 100, func() {
		victim.Kill()
		go func() {
			var err error
			detection, err = c.WaitRings(t.Context(), survivors, 3*time.Second, victim)
			detected <- err
		}()
	})
	wg.Wait()
	if err != nil {
		t.Fatalf("stream entering on a survivor broke when its owner died: %v", err)
	}
	if resumed != reference {
		i := 0
		for i < min(len(resumed), len(reference)) && resumed[i] == reference[i] {
			i++
		}
		t.Errorf("resumed answer differs from the uninterrupted one at byte %d of %d:\nresumed   ...%q\nreference ...%q",
			i, len(reference), resumed[max(0, i-40):min(len(resumed), i+40)], reference[max(0, i-40):min(len(reference), i+40)])
	}
	if onVictimErr == nil {
		t.Error("a stream entering on the killed node ended cleanly")
	}
	if !strings.Contains(metrics(t, c.Nodes[0]), "infernode_resumes_total 1") {
		t.Error("node1 does not count the resume")
	}
	if markers != 1 {
		t.Errorf("the resumed stream carried %d resume markers, want 1", markers)
	}
	if r := reused() - reusedBefore; r < 100 {
		t.Errorf("the survivors reused %v cached tokens resuming the stream, want more than the 100 it had sent (the replica)", r)
	} else {
		t.Logf("the stream resumed on the replica: %v tokens reused", r)
	}

	if err := <-detected; err != nil {
		t.Fatal(err)
	}
	t.Logf("every survivor's ring dropped %s %v after kill -9", victim.ID, detection.Round(time.Millisecond))
	for _, n := range []*Node{c.Nodes[0], c.Nodes[2]} {
		if a := chat(t, n.URL(), msgs, 4); a.status != 200 || a.node == victim.ID {
			t.Errorf("after the drop, via %s: status %d served by %q", n.ID, a.status, a.node)
		}
	}

	restartAt := time.Now()
	if err := victim.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(), 6*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s back on every ring %v after restart", victim.ID, time.Since(restartAt).Round(time.Millisecond))
	if a := chat(t, c.Nodes[2].URL(), msgs, 4); a.node != victim.ID {
		t.Errorf("after restart the conversation is served by %s, want its owner %s again", a.node, victim.ID)
	}
}

// TestLeaveOwner: an owner sent SIGTERM while another node forwards streams to it finishes
// every one of them (none resumed, none failed), new turns of its conversations go to the
// next owners at once, and it exits cleanly.
func TestLeaveOwner(t *testing.T) {
	c := startCluster(t, 3)
	entry, victim := c.Nodes[0], c.Nodes[1]
	convs := ownedBy(t, entry, victim, 8, 400, func(i int) []message {
		return []message{{"system", fmt.Sprintf("story %d", i)}, {"user", "tell me everything"}}
	})
	type result struct {
		served  string
		markers int
		err     error
	}
	results := make([]result, len(convs))
	streaming := make(chan struct{}, len(convs))
	var wg sync.WaitGroup
	for i, m := range convs {
		wg.Go(func() {
			_, served, markers, err := streamChat(entry.URL(), m, 600, 8, func() { streaming <- struct{}{} })
			results[i] = result{served, markers, err}
		})
	}
	for range convs {
		<-streaming
	}
	left := time.Now()
	if err := victim.signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, r := range results {
		if r.err != nil || r.markers != 0 || r.served != victim.ID {
			t.Errorf("stream %d: served by %s, %d resumes, %v; want finished by %s, never resumed", i, r.served, r.markers, r.err, victim.ID)
		}
	}
	if !victim.wait(30 * time.Second) {
		t.Fatalf("%s still running 30s after SIGTERM", victim.ID)
	}
	if err := victim.Err(); err != nil {
		t.Errorf("%s exited with %v after a graceful leave", victim.ID, err)
	}
	t.Logf("%s finished %d forwarded streams and exited %v after SIGTERM", victim.ID, len(convs), time.Since(left).Round(time.Millisecond))
	for _, m := range convs[:2] {
		if a := chat(t, entry.URL(), m, 4); a.status != 200 || a.node == victim.ID {
			t.Errorf("after the leave: status %d served by %q", a.status, a.node)
		}
	}
	if strings.Contains(metrics(t, entry), "infernode_resumes_total 1") {
		t.Error("the entry node resumed a stream")
	}
}

func metrics(t *testing.T, n *Node) string {
	resp, err := client.Get(n.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestIncompatibleNode: a node whose fingerprint differs (here: another KV cache type)
// joins gossip but is on no ring, and every node shows it as incompatible.
func TestIncompatibleNode(t *testing.T) {
	c := startCluster(t, 2)
	odd, err := c.Add(t.Context(), "odd", "--kv-type", "q8_0")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes[:2] {
		poll.Until(t, 15*time.Second, n.ID+" to see odd as alive, ready and incompatible", func() bool {
			v, err := c.View(n)
			return err == nil && slices.ContainsFunc(v.Members, func(m MemberView) bool {
				return m.ID == "odd" && m.State == "alive" && m.Ready && !m.Compatible
			})
		})
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(c.Nodes[0], c.Nodes[1]), 5*time.Second, odd); err != nil {
		t.Fatal(err)
	}
	if ring, _ := c.Ring(odd); !slices.Equal(ring, []string{"odd"}) {
		t.Errorf("odd's ring = %v, want only itself", ring)
	}
	// Requests entering anywhere never reach odd from the others.
	for i := range 20 {
		a := chat(t, c.Nodes[i%2].URL(), []message{{"user", fmt.Sprint("question ", i)}}, 2)
		if a.node == "odd" {
			t.Errorf("request %d was served by the incompatible node", i)
		}
	}
}

// TestCancelAcrossHop: a client that disconnects from the entry node cancels the
// generation on the owner, across the hop.
func TestCancelAcrossHop(t *testing.T) {
	c := startCluster(t, 2)
	entry, owner := c.Nodes[0], c.Nodes[1]
	var msgs []message
	for i := 0; msgs == nil; i++ {
		m := []message{{"user", fmt.Sprint("a long story ", i)}}
		if chat(t, entry.URL(), m, 1).node == owner.ID {
			msgs = m
		}
	}
	body, _ := json.Marshal(map[string]any{"messages": msgs, "max_tokens": 4000, "stream": true})
	resp, err := client.Post(entry.URL()+"/v1/chat/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	for range 20 {
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	if !strings.Contains(metrics(t, owner), "infernode_running_sequences 1") {
		t.Fatal("the owner is not running the stream")
	}
	resp.Body.Close()
	closed := time.Now()
	for !strings.Contains(metrics(t, owner), "infernode_running_sequences 0") {
		if time.Since(closed) > 2*time.Second {
			t.Fatal("the owner kept generating for 2s after the client left the entry node")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("owner freed the sequence %v after the client disconnected from the entry node", time.Since(closed).Round(time.Millisecond))
	if m := metrics(t, owner); !strings.Contains(m, `infernode_cancellations_total{cause="client_disconnect"} 1`) {
		t.Error("the owner does not count the disconnect")
	}
}

// LimitCPU holds a node to a share of one CPU, in the default period and a short one: its
// generation rate drops to about that share of what it was (with whatever backend this
// machine allows), and Unlimit gives it back. A share or a quota the kernel would refuse
// is refused.
func TestLimitCPU(t *testing.T) {
	c := startCluster(t, 1, "--threads", "1")
	n := c.Nodes[0]
	rate := func() float64 {
		start := time.Now()
		tokens := 0
		for i := 0; time.Since(start) < 3*time.Second; i++ {
			a := chat(t, n.URL(), []message{{"user", fmt.Sprint("limit question ", i)}}, 64)
			if a.status != 200 {
				t.Fatalf("chat: %d", a.status)
			}
			tokens += 64
		}
		return float64(tokens) / time.Since(start).Seconds()
	}
	for _, refused := range []struct {
		percent int
		period  time.Duration
	}{{0, CPUPeriod}, {25, 2 * time.Millisecond}} { // no share; a quota of 0.5 ms (the kernel's least is 1 ms)
		if _, err := n.LimitCPU(refused.percent, refused.period); err == nil || n.cpu != nil {
			t.Errorf("%d%% in %v periods: error %v, limit in force: %v; want refused, and nothing in force", refused.percent, refused.period, err, n.cpu != nil)
		}
	}
	free := rate()
	for _, period := range []time.Duration{CPUPeriod, 10 * time.Millisecond} {
		backend, err := n.LimitCPU(25, period)
		if err != nil {
			t.Logf("LimitCPU: %v", err)
		}
		limited := rate()
		if err := n.Unlimit(); err != nil {
			t.Fatal(err)
		}
		again := rate()
		t.Logf("tokens/s: %.0f free, %.0f at 25%% of a CPU in %v periods (%s), %.0f after", free, limited, period, backend, again)
		if limited > 0.45*free || again < 0.7*free {
			t.Errorf("a node at 25%% of a CPU in %v periods generated %.0f tokens/s against %.0f free (%.0f after): want well under half, and back", period, limited, free, again)
		}
	}
}
