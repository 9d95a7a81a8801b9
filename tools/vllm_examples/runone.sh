#!/bin/bash
# usage: runone.sh NAME script args...  runs one converted example in $TRIAL/run (timeout $TO s,
# default 300), log in $TRIAL/logs/NAME.log, "NAME rc=.. t=..s" appended to $TRIAL/results.txt.
TRIAL=${TRIAL:-/tmp/vllm_trial}
name=$1; shift
cd "$TRIAL/run"
start=$(date +%s)
timeout "${TO:-300}" python "$@" > "$TRIAL/logs/$name.log" 2>&1
rc=$?
echo "$name rc=$rc t=$(( $(date +%s)-start ))s" >> "$TRIAL/results.txt"
