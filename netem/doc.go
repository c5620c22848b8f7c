// Package netem builds network topologies for testing clusters of processes and breaks
// them on purpose: one network namespace per node, joined by veth pairs to a bridge, with
// partitions, packet loss and bandwidth caps set and healed at run time.
//
// Each topology takes a /24 of 10.77.0.0/16 that nothing on the machine uses yet
// (Topology.Subnet), which exists only on its bridge and inside its namespaces: the bridge
// (where the test driver lives, Topology.DriverIP) is 10.77.X.1, node i is 10.77.X.(10+i).
// So two topologies, or one and another run's leftovers, never share a subnet. Every object
// netem creates is named with a prefix ("inf" by default) so Cleanup can remove leftovers
// of a killed run.
//
// Backends: partitions and loss use nftables in the node's namespace (loss with numgen
// random), bandwidth uses the tbf qdisc. Delay and jitter use sch_netem where the kernel
// has it and the delay is for every host; otherwise (these CI kernels lack sch_netem) an
// NFQUEUE rule hands the packets to this process, which releases each when its delay has
// passed. Delay reports ErrUnsupported when neither is possible rather than pretending.
//
// Everything needs root (CAP_NET_ADMIN) and the ip, tc and nft commands; Available says
// whether this machine has them.
package netem
