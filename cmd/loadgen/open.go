package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// Open-loop load (--rate): requests arrive when the workload says, whatever the server's
// latency, as serving benchmarks measure (vLLM's benchmark_serving --request-rate,
// DistServe's goodput), instead of a fixed number of clients that each wait for an answer
// before asking again (which slows the arrivals exactly when the server is slow).
//
// The workload is synthesized from a seed, so two runs (and two servers) get the same one:
//
//   - Conversations start as a Poisson process at rate/turnsMean a second, so requests
//     arrive at about rate a second.
//   - A conversation has 1 + Geometric turns (mean turnsMean, at most maxTurns). A
//     follow-up is sent when the previous answer has ended plus a think time, Exp(mean
//     thinkMean): a user waits for an answer, so follow-ups follow the server, first
//     turns do not. Every follow-up carries the whole history (the previous answers
//     included), so prompts grow turn by turn.
//   - A user message is LogNormal(median 40 words, sigma 0.8) long, 4 to 400 words; an
//     answer's max_tokens LogNormal(median 48, sigma 0.6), 8 to 256: long-tailed, as chat
//     traffic is.
//
// A request meets the SLO when its first token came within sloTTFT and its time per
// output token after the first, (end-first)/(tokens-1), is within sloTPOT. Goodput is
// the requests meeting it a second.

const (
	turnsMean = 3.0
	maxTurns  = 8
	thinkMean = time.Second
)

// turn is one request of a conversation as the workload planned it.
type turn struct {
	words, maxTokens int
}

// conversation is a planned conversation: when it starts and its turns.
type conversation struct {
	id    string
	at    time.Duration
	turns []turn
}

// plan synthesizes the workload for rate over duration from seed. The draws do not depend
// on the rate: a seed's conversations are the same at every rate, arriving at times that
// scale with 1/rate, so a higher rate of a sweep is the same workload, denser, and more of
// it fits in the duration. (Drawn apart by rate, a minute's sample of a long-tailed
// workload can be lighter at a higher rate than at a lower one.)
func plan(rate float64, duration time.Duration, seed uint64) []conversation {
	rng := rand.New(rand.NewPCG(seed, 0))
	logNormal := func(median, sigma float64, lo, hi int) int {
		return max(lo, min(hi, int(math.Round(median*math.Exp(sigma*rng.NormFloat64())))))
	}
	var out []conversation
	for at := time.Duration(0); ; {
		at += time.Duration(rng.ExpFloat64() / (rate / turnsMean) * float64(time.Second))
		if at >= duration {
			return out
		}
		c := conversation{id: fmt.Sprintf("loadgen-%d-%g-%d", seed, rate, len(out)), at: at}
		for n := 1; ; n++ {
			c.turns = append(c.turns, turn{words: logNormal(40, 0.8, 4, 400), maxTokens: logNormal(48, 0.6, 8, 256)})
			if n == maxTurns || rng.Float64() < 1/turnsMean { // geometric: mean turnsMean
				break
			}
		}
		out = append(out, c)
	}
}

// vocabulary the synthesized messages are drawn from.
var vocabulary = strings.Fields(`the a river mountain town story old new small great quiet
bright dark morning evening road house garden tree water stone light wind rain sun moon
friend child teacher king boat bridge market song book letter door window field forest
walked found told asked built carried watched remembered opened followed crossed waited`)

func message(rng *rand.Rand, words int) string {
	w := make([]string, words)
	for i := range w {
		w[i] = vocabulary[rng.IntN(len(vocabulary))]
	}
	return strings.Join(w, " ")
}

// messageRNG draws conversation i's messages and think times. It depends on the rate so
// that the rates of a sweep, which share their conversations' shapes, do not send the same
// words: a server's cache of one rate's prompts must not serve the next rate's.
func messageRNG(seed uint64, rate float64, i int) *rand.Rand {
	return rand.New(rand.NewPCG(seed, math.Float64bits(rate)^uint64(i)))
}

// openRun sends rate's workload for duration and measures it against the SLO; it returns
// the requests too. Follow-ups still due at the end are not sent; requests in flight are
// waited for.
func openRun(ctx context.Context, client *http.Client, t target, rate float64, duration time.Duration, seed uint64,
	sloTTFT, sloTPOT time.Duration, scales []float64) (measure.OpenLevel, []result) {
	convs := plan(rate, duration, seed)
	start := time.Now()
	var mu sync.Mutex
	var results []result
	var wg sync.WaitGroup
	for i, c := range convs {
		wg.Go(func() {
			rng := messageRNG(seed, rate, i)
			if !sleepUntil(ctx, start.Add(c.at)) {
				return
			}
			var history []map[string]string
			for k, tn := range c.turns {
				if k > 0 {
					think := time.Duration(rng.ExpFloat64() * float64(thinkMean))
					if time.Since(start)+think >= duration || !sleepUntil(ctx, time.Now().Add(think)) {
						return
					}
				}
				history = append(history, map[string]string{"role": "user", "content": message(rng, tn.words)})
				res := t.stream(client, history, c.id, tn.maxTokens, int64(seed)+int64(i*maxTurns+k))
				res.conversation, res.turn = c.id, k
				mu.Lock()
				results = append(results, res)
				mu.Unlock()
				if res.err != nil {
					return
				}
				history = append(history, map[string]string{"role": "assistant", "content": res.text})
			}
		})
	}
	wg.Wait()
	return summarizeOpen(rate, results, duration, sloTTFT, sloTPOT, scales), results
}

// record is r as --records writes it.
func (r result) record() measure.Request {
	q := measure.Request{Conversation: r.conversation, Turn: r.turn, Start: r.start, Tokens: r.tokens, PromptTokens: r.promptTokens,
		CachedTokens: r.cachedTokens, Resumed: r.resumed, Upstream: r.upstream, Node: r.node}
	if !r.first.IsZero() {
		q.TTFTms = float64(r.first.Sub(r.start).Microseconds()) / 1000
	}
	if r.err != nil {
		q.Error = r.err.Error()
	}
	return q
}

// sleepUntil waits until t or ctx's end, and reports whether t came.
func sleepUntil(ctx context.Context, t time.Time) bool {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// tpot is a request's time per output token after the first (0 for one token).
func (r result) tpot() time.Duration {
	if r.tokens < 2 || r.first.IsZero() {
		return 0
	}
	return r.end.Sub(r.first) / time.Duration(r.tokens-1)
}

// summarizeOpen measures a run's results against the SLO, and against it times each of
// scales.
func summarizeOpen(rate float64, rs []result, duration, sloTTFT, sloTPOT time.Duration, scales []float64) measure.OpenLevel {
	l := measure.OpenLevel{Rate: rate, Requests: len(rs), Achieved: float64(len(rs)) / duration.Seconds()}
	var ttft, tpot, gaps, follow, endWait []time.Duration
	var prompts []int
	var followPrompt, followCached int
	cacheReported := false
	for _, r := range rs {
		l.Resumed += r.resumed
		if r.err != nil || r.first.IsZero() {
			l.Failed++
			continue
		}
		prompts = append(prompts, r.promptTokens)
		l.Answered += r.promptTokens + r.tokens
		ttft = append(ttft, r.first.Sub(r.start))
		tpot = append(tpot, r.tpot())
		gaps = append(gaps, r.gaps...)
		if len(r.events) > 0 {
			endWait = append(endWait, r.end.Sub(r.events[len(r.events)-1]))
		}
		if r.turn > 0 {
			follow = append(follow, r.first.Sub(r.start))
			followPrompt, followCached = followPrompt+r.promptTokens, followCached+r.cachedTokens
			cacheReported = cacheReported || r.cacheReported
		}
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	l.TTFTp50ms, l.TTFTp99ms = ms(measure.Percentile(ttft, 50)), ms(measure.Percentile(ttft, 99))
	l.FollowTTFTp50ms, l.FollowTTFTp99ms = ms(measure.Percentile(follow, 50)), ms(measure.Percentile(follow, 99))
	switch {
	case !cacheReported:
		l.FollowCached = -1
	case followPrompt > 0:
		l.FollowCached = float64(followCached) / float64(followPrompt)
	}
	l.TPOTp50ms, l.TPOTp99ms = ms(measure.Percentile(tpot, 50)), ms(measure.Percentile(tpot, 99))
	l.ITLp50ms, l.ITLp99ms = ms(measure.Percentile(gaps, 50)), ms(measure.Percentile(gaps, 99))
	l.EndWaitp50ms, l.EndWaitp99ms = ms(measure.Percentile(endWait, 50)), ms(measure.Percentile(endWait, 99))
	if len(prompts) > 0 {
		slices.Sort(prompts)
		l.PromptP50 = prompts[len(prompts)/2]
	}
	attain := func(scale float64) measure.Scaled {
		met := 0
		for i := range ttft { // failed requests meet nothing
			if ttft[i] <= time.Duration(scale*float64(sloTTFT)) && tpot[i] <= time.Duration(scale*float64(sloTPOT)) {
				met++
			}
		}
		sc := measure.Scaled{Scale: scale, Goodput: float64(met) / duration.Seconds()}
		if len(rs) > 0 {
			sc.Attainment = float64(met) / float64(len(rs))
		}
		return sc
	}
	one := attain(1)
	l.Attainment, l.Goodput = one.Attainment, one.Goodput
	for _, s := range scales {
		l.Scaled = append(l.Scaled, attain(s))
	}
	return l
}
