package gossip

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// ValidateHostPort accepts host:port and nothing else: a host name or IP address and a port
// in 1-65535.
func ValidateHostPort(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("address %q is not host:port: %w", addr, err)
	}
	if host == "" || strings.ContainsAny(host, "/?#@%\\ \t\r\n") {
		return fmt.Errorf("address %q: bad host", addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != port {
		return fmt.Errorf("address %q: bad port", addr)
	}
	return nil
}
