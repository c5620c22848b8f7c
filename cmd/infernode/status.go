package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/infernode/infernode/node/routing"
)

// status prints GET /v1/cluster of one node as a table, once or (--watch) refreshed in
// place until ctx ends.
func status(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("infernode status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "http://127.0.0.1:8081", "base URL of any node")
	apiKey := fs.String("api-key", "", "API key, if the node requires one")
	watch := fs.Bool("watch", false, "refresh the table in place until interrupted")
	every := fs.Duration("interval", time.Second, "how often --watch refreshes")
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: infernode status [--addr URL] [--watch]\n\nPrints the cluster as the node at URL sees it.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if *every <= 0 {
		fmt.Fprintln(stderr, "infernode status: --interval must be positive")
		return 2
	}
	url := strings.TrimSuffix(*addr, "/")
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	client := &http.Client{Timeout: 5 * time.Second}
	if !*watch {
		table, err := clusterTable(client, url, *apiKey)
		if err != nil {
			fmt.Fprintf(stderr, "infernode status: %v\n", err)
			return 1
		}
		stdout.Write(table)
		return 0
	}
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for {
		table, err := clusterTable(client, url, *apiKey)
		if err != nil { // a node restarting: say so and keep watching
			table = fmt.Appendf(nil, "infernode status: %v\n", err)
		}
		// Home, the table, then clear what an earlier, longer table left below it.
		fmt.Fprintf(stdout, "\x1b[H%s%s\n\x1b[J", bytes.ReplaceAll(table, []byte("\n"), []byte("\x1b[K\n")),
			time.Now().Format("15:04:05")+" (Ctrl-C stops)")
		select {
		case <-ctx.Done():
			return 0
		case <-tick.C:
		}
	}
}

// clusterTable asks the node at url for its view of the cluster and renders it.
func clusterTable(client *http.Client, url, apiKey string) ([]byte, error) {
	req, err := http.NewRequest("GET", url+"/v1/cluster", nil)
	if err != nil {
		return nil, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var v routing.View
	if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&v) != nil {
		return nil, fmt.Errorf("%s answered %d without a cluster view", url, resp.StatusCode)
	}
	var out bytes.Buffer
	fmt.Fprintf(&out, "cluster as %s sees it\n", v.Self)
	tw := tabwriter.NewWriter(&out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tHTTP\tGOSSIP\tSTATE\tHEALTHY\tREADY\tMODEL\tRING\tRUNNING\tWAITING\tFREE KV\tTOK/S")
	for _, m := range v.Members {
		ring := "-"
		if m.OnRing {
			ring = fmt.Sprintf("%.1f%%", 100*m.RingShare)
		}
		model := m.Model
		switch {
		case model == "":
			model = m.Fingerprint[:min(12, len(m.Fingerprint))]
		case m.Reason == "hop protocol":
			model += " (incompatible hop)"
		}
		state := m.State
		if m.Degraded {
			state += " (degraded)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%v\t%s\t%s\t%d\t%d\t%d\t%d\n", m.ID, m.HTTPAddr, m.GossipAddr, state,
			m.Healthy, m.Ready, model, ring, m.Load["running"], m.Load["waiting"], m.Load["free_kv"], m.TokensPerS)
	}
	tw.Flush()
	return out.Bytes(), nil
}
