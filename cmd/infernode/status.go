package main

import (
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

// status prints GET /v1/cluster of one node as a table.
func status(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("infernode status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "http://127.0.0.1:8081", "base URL of any node")
	apiKey := fs.String("api-key", "", "API key, if the node requires one")
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: infernode status [--addr URL]\n\nPrints the cluster as the node at URL sees it.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	url := strings.TrimSuffix(*addr, "/")
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	req, _ := http.NewRequest("GET", url+"/v1/cluster", nil)
	if *apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+*apiKey)
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		fmt.Fprintf(stderr, "infernode status: %v\n", err)
		return 1
	}
	defer resp.Body.Close()
	var v routing.View
	if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&v) != nil {
		fmt.Fprintf(stderr, "infernode status: %s answered %d without a cluster view\n", url, resp.StatusCode)
		return 1
	}
	fmt.Fprintf(stdout, "cluster as %s sees it\n", v.Self)
	tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tHTTP\tGOSSIP\tSTATE\tHEALTHY\tREADY\tCOMPATIBLE\tRING\tRUNNING\tWAITING\tFREE KV")
	for _, m := range v.Members {
		ring := "-"
		if m.OnRing {
			ring = fmt.Sprintf("%.1f%%", 100*m.RingShare)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%v\t%v\t%s\t%d\t%d\t%d\n", m.ID, m.HTTPAddr, m.GossipAddr, m.State,
			m.Healthy, m.Ready, m.Compatible, ring, m.Load["running"], m.Load["waiting"], m.Load["free_kv"])
	}
	tw.Flush()
	return 0
}
