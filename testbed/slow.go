package testbed

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Slow nodes: a node limited to a share of one CPU, as a noisy neighbour, throttling or a
// busy host would leave it. It answers everything, slowly: a gray failure.

// cpuLimit is one node's CPU limit in force; lift undoes it.
type cpuLimit struct {
	backend string
	lift    func() error
}

// CPUPeriod is the period of LimitCPU's quota unless told otherwise: the kernel's and
// Kubernetes' default.
const CPUPeriod = 100 * time.Millisecond

// LimitCPU limits the node's process to percent of one CPU in every period: with cgroup
// v2's cpu.max where the unified hierarchy has the cpu controller, else cgroup v1's CFS
// quota, else (no writable cgroup) a SIGSTOP/SIGCONT duty cycle. It returns the backend
// used. A restart of the node, or Unlimit, lifts it.
//
// The period matters mostly to latency: a process that spends its quota early in a period
// is stopped for the rest of it (80 ms of every 100 at 20%), where a CPU a fifth as fast
// would only be slower. A short period makes the limit behave more like the slower CPU,
// at some cost in throughput (the kernel hands out quota in slices, and a short period
// strands more of it); the kernel takes no quota under 1 ms.
func (n *Node) LimitCPU(percent int, period time.Duration) (string, error) {
	if percent < 1 || percent > 100 {
		return "", fmt.Errorf("testbed: CPU share must be 1..100%%, got %d", percent)
	}
	quota := period * time.Duration(percent) / 100
	if quota < time.Millisecond || period > time.Second {
		return "", fmt.Errorf("testbed: a CPU period of %v gives a quota of %v (want 1ms..1s)", period, quota)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil || n.cmd.Process == nil {
		return "", errors.New("testbed: node not running")
	}
	pid := n.cmd.Process.Pid
	if n.cpu != nil {
		n.cpu.lift()
		n.cpu = nil
	}
	periodUS, quotaUS := int(period/time.Microsecond), int(quota/time.Microsecond)
	name := fmt.Sprintf("infernode-%s-%d", n.ID, pid)
	var errs []error
	if dir, ok := cgroupV2CPU(); ok {
		l, err := cgroupLimit(filepath.Join(dir, name), "cgroup v2 cpu.max", pid,
			map[string]string{"cpu.max": fmt.Sprintf("%d %d", quotaUS, periodUS)}, filepath.Join(dir, "cgroup.procs"))
		if err == nil {
			n.cpu = l
			return l.backend, nil
		}
		errs = append(errs, err)
	}
	if dir := "/sys/fs/cgroup/cpu"; writable(dir) {
		l, err := cgroupLimit(filepath.Join(dir, name), "cgroup v1 cpu.cfs_quota_us", pid,
			map[string]string{"cpu.cfs_period_us": strconv.Itoa(periodUS), "cpu.cfs_quota_us": strconv.Itoa(quotaUS)},
			filepath.Join(dir, "cgroup.procs"))
		if err == nil {
			n.cpu = l
			return l.backend, nil
		}
		errs = append(errs, err)
	}
	n.cpu = dutyCycle(pid, quota, period)
	if len(errs) > 0 {
		return n.cpu.backend, fmt.Errorf("cgroups not usable (%w); fell back to %s", errors.Join(errs...), n.cpu.backend)
	}
	return n.cpu.backend, nil
}

// Unlimit lifts the node's CPU limit, if any.
func (n *Node) Unlimit() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cpu == nil {
		return nil
	}
	err := n.cpu.lift()
	n.cpu = nil
	return err
}

// cgroupV2CPU is the unified hierarchy's root when it has the cpu controller.
func cgroupV2CPU() (string, bool) {
	for _, dir := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
		if err == nil && strings.Contains(" "+string(b)+" ", " cpu ") && writable(dir) {
			return dir, true
		}
	}
	return "", false
}

func writable(dir string) bool {
	return syscall.Access(dir, 2 /* W_OK */) == nil
}

// cgroupLimit makes cgroup dir with settings, moves pid (every thread) into it, and
// returns the limit; lifting it moves the process back to root (the parent's procs file)
// and removes the group.
func cgroupLimit(dir, backend string, pid int, settings map[string]string, rootProcs string) (*cpuLimit, error) {
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return nil, err
	}
	// cfs_period before cfs_quota: a quota above the old period is refused.
	for _, k := range []string{"cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.max"} {
		if v, ok := settings[k]; ok {
			if err := os.WriteFile(filepath.Join(dir, k), []byte(v), 0o644); err != nil {
				os.Remove(dir)
				return nil, fmt.Errorf("%s: %w", k, err)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("move %d into %s: %w", pid, dir, err)
	}
	return &cpuLimit{backend: backend, lift: func() error {
		err := os.WriteFile(rootProcs, []byte(strconv.Itoa(pid)), 0o644)
		if err != nil && !errors.Is(err, syscall.ESRCH) {
			return err
		}
		return os.Remove(dir)
	}}, nil
}

// dutyCycle lets pid run for on in every period, stopped the rest of it.
func dutyCycle(pid int, on, period time.Duration) *cpuLimit {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer syscall.Kill(pid, syscall.SIGCONT)
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			syscall.Kill(pid, syscall.SIGCONT)
			select {
			case <-stop:
				return
			case <-time.After(on):
			}
			syscall.Kill(pid, syscall.SIGSTOP)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	return &cpuLimit{backend: "SIGSTOP/SIGCONT duty cycle", lift: func() error {
		close(stop)
		<-done
		return nil
	}}
}
