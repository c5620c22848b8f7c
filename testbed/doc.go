// Package testbed launches real infernode processes and drives them: it starts clusters on
// loopback, waits until every ring has converged, kills, pauses and restarts nodes, and
// runs workloads against them. It talks to nodes only over HTTP and signals, never by
// importing them.
package testbed
