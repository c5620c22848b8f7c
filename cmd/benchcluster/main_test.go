package main

import (
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// TestSortKill: a kill run's failed answers are told apart by the connection they came
// through; a follow-up after the kill counts as the killed backend's when the turn before
// it was served there before the kill; a follow-up whose turn before came after the kill,
// or failed, counts in neither list.
func TestSortKill(t *testing.T) {
	at := time.Unix(100, 0)
	before, after := at.Add(-time.Second), at.Add(time.Second)
	reqs := []measure.Request{
		{Conversation: "a", Turn: 0, Start: before, Node: "node2", Upstream: "u1"},
		{Conversation: "a", Turn: 1, Start: after, TTFTms: 40, PromptTokens: 100, CachedTokens: 80, Node: "node1", Upstream: "u1", Resumed: 0},
		{Conversation: "b", Turn: 1, Start: after, TTFTms: 30, Upstream: "u1"},
		{Conversation: "b", Turn: 0, Start: before, Node: "node1", Upstream: "u2"},
		{Conversation: "c", Turn: 0, Start: before, Upstream: "u2", Error: "the stream ended before [DONE]"},
		{Conversation: "d", Turn: 0, Start: before, Upstream: "u1", Error: "status 503", Resumed: 1},
		{Conversation: "e", Turn: 0, Start: after, Node: "node2"},
		{Conversation: "e", Turn: 1, Start: after.Add(time.Second), TTFTms: 10},
		{Conversation: "f", Turn: 0, Start: before, Node: "node2"},
		{Conversation: "f", Turn: 1, Start: after, Error: "refused"},
		{Conversation: "f", Turn: 2, Start: after, TTFTms: 5},
		// nginx tried the killed backend, then streamed from the other; and the other way.
		{Conversation: "g", Turn: 0, Start: before, Upstream: "u2, u1", Error: "status 502"},
		{Conversation: "h", Turn: 0, Start: before, Upstream: "u1, u2", Error: "unexpected EOF"},
	}
	k := sortKill(reqs, at, "node2", "u2")
	if k.failed != 5 || k.throughKilled != 2 || k.resumed != 1 {
		t.Errorf("failed %d, through the killed process %d, resumed %d; want 5, 2, 1", k.failed, k.throughKilled, k.resumed)
	}
	if !slices.Equal(k.moved, []time.Duration{40 * time.Millisecond}) || k.movedPrompt != 100 || k.movedCached != 80 {
		t.Errorf("the killed backend's follow-ups %v (prompt %d, cached %d), want [40ms] (100, 80)", k.moved, k.movedPrompt, k.movedCached)
	}
	if !slices.Equal(k.others, []time.Duration{30 * time.Millisecond}) {
		t.Errorf("other follow-ups %v, want [30ms]", k.others)
	}
}

// TestGroupCPU: a process group's CPU time counts its children (a shell's busy loop in a
// subshell), and a group with no process counts none.
func TestGroupCPU(t *testing.T) {
	cmd := exec.Command("sh", "-c", "(while :; do :; done) & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); cmd.Wait() }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		cpu, err := groupCPU([]int{cmd.Process.Pid, 1 << 30})
		if err != nil {
			t.Fatal(err)
		}
		if cpu[1] != 0 {
			t.Fatalf("a group with no process used %v s", cpu[1])
		}
		if cpu[0] >= 0.2 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the busy group used %v s in 10 s", cpu[0])
		}
	}
}
