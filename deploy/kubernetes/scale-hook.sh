#!/bin/sh
# The autoscaler's hook for Kubernetes: infernode runs it (--scale-hook) on the one node
# that fires, with the ring's node count and the count its controller wants. It scales the
# StatefulSet of deploy/kubernetes/infernode.yaml; a scale-in stops the highest pods, each
# of which leaves gracefully (SIGTERM: it drains and hands its conversations' KV and
# stored responses to the next owners), so nothing is lost. The pod's service account
# needs "patch" on statefulsets/scale in its namespace.
#
#   infernode ... --scale-hook /etc/infernode/scale-hook.sh --scale-min 2 --scale-max 8
#
# The desired count is also the metric infernode_desired_nodes, which an HPA or KEDA
# ScaledObject can follow instead (then run no hook).
set -eu
: "${INFERNODE_DESIRED_NODES:?}"
exec kubectl scale statefulset/"${INFERNODE_STATEFULSET:-infernode}" --replicas="$INFERNODE_DESIRED_NODES"
