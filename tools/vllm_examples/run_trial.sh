#!/bin/bash
# vLLM's text-only example scripts on pagedllm (issue 28; results in docs/vllm_examples.md).
# Setup: TRIAL holds vllm-0.33.0/ (vLLM's PyPI sdist, unpacked) and run/ (its examples/ after
# convert.py: 'vllm' -> 'pagedllm' in imports, the model names -> "default"; from $TRIAL:
# (cd vllm-0.33.0/examples && find . -name '*.py') | xargs python tools/vllm_examples/convert.py).
# Usage: PAGEDLLM=/path/to/checkout tools/vllm_examples/run_trial.sh   (sequential; ~40 min on 2 cores)
set -u
TRIAL=${TRIAL:-/tmp/vllm_trial}
export PYTHONPATH=${PAGEDLLM:-$(cd "$(dirname "$0")/../.." && pwd)}
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$TRIAL"; mkdir -p logs
runone() { TRIAL=$TRIAL "$HERE/runone.sh" "$@"; }
# The prompt_embed and token_generation scripts load a tokenizer (and an HF model) by name with transformers: they get
# default_hf/, the default model's converted folder (linked) with the bundled Gemma chat template
# (the base model's tokenizer has none), as model_name; the server also serves that name.
HF=$TRIAL/default_hf; mkdir -p "$HF"
ln -sf "$(python -c "from pagedllm.loaders.model_files import resolve_model; print(resolve_model('default').folder)" | tail -1)"/* "$HF"/
cp "$PYTHONPATH/pagedllm/data/gemma_chat_template.jinja" "$HF/chat_template.jinja"
for s in prompt_embed_offline prompt_embed_inference_with_openai_client; do
  sed "s|model_name = \"default\"|model_name = \"$HF\"|" run/features/prompt_embed/$s.py > run/features/prompt_embed/${s}_folder.py
done
sed "s|MODEL_NAME = \"default\"|MODEL_NAME = \"$HF\"|" run/scale_out/token_generation_client.py > run/scale_out/token_generation_client_folder.py
: > results.txt
echo "START $(date -u +%H:%M:%S) $(cd "$PYTHONPATH" && git rev-parse --short HEAD)" >> results.txt
# offline scripts
runone basic basic/offline_inference/basic.py
runone chat basic/offline_inference/chat.py
runone generate basic/offline_inference/generate.py
runone async_llm_streaming deployment/async_llm_streaming.py
runone llm_engine_example deployment/llm_engine_example.py --model default
runone apc_offline features/automatic_prefix_caching/automatic_prefix_caching_offline.py
runone prefix_caching_offline features/automatic_prefix_caching/prefix_caching_offline.py
runone context_extension features/context_extension/context_extension_offline.py
runone lp_custom features/logits_processor/custom.py
runone lp_custom_req features/logits_processor/custom_req.py
runone lp_custom_req_init features/logits_processor/custom_req_init.py
runone lp_dry features/logits_processor/dry.py
runone run_one_batch features/profiling/run_one_batch_offline.py
runone simple_profiling features/profiling/simple_profiling_offline.py
runone reset_kv features/reset_kv/reset_kv_offline.py --model default
runone structured_outputs_offline features/structured_outputs/structured_outputs_offline.py
runone metrics_offline observability/metrics/offline.py
runone reproducibility rl/batch_invariance/reproducibility_offline.py
runone pause_resume_offline rl/pause_resume/pause_resume_offline.py
runone skip_loading_weights rl/skip_loading_weights_in_engine_init.py
runone chat_with_tools_offline tool_calling/chat_with_tools_offline.py
runone qwen_1m generate/qwen_1m_offline.py
runone trace_replay generate/trace_replay_offline.py
runone prompt_embed_offline features/prompt_embed/prompt_embed_offline_folder.py
# offline scripts, batch 2 (data_parallel_offline: 2 engines x 200 prompts)
export TO=600
runone data_parallel_offline features/data_parallel/data_parallel_offline.py -dp=2
runone multi_instance_dp features/data_parallel/multi_instance_data_parallel.py
# --model: a local folder (the script checks); the default model's converted folder
DEFAULT_FOLDER=$(python -c "from pagedllm.loaders.model_files import resolve_model; print(resolve_model('default').folder)" 2>/dev/null | tail -1)
rm -rf "$TRIAL/sharded"
runone save_sharded features/sharded_state/save_sharded_state_offline.py --model "$DEFAULT_FOLDER" --output $TRIAL/sharded
runone load_sharded features/sharded_state/load_sharded_state_offline.py --model $TRIAL/sharded
rm -rf "$TRIAL/tens"
runone tensorize features/tensorize_vllm_model.py --model default serialize --serialized-directory $TRIAL/tens --suffix v1
runone tensorize_load features/tensorize_vllm_model.py --model default deserialize --path-to-tensors $TRIAL/tens/vllm/default/v1/model.tensors
runone torchrun_example -m torch.distributed.run --nproc-per-node=4 features/torchrun/torchrun_example_offline.py
runone torchrun_dp -m torch.distributed.run --nproc-per-node=2 features/torchrun/torchrun_dp_example_offline.py
# vLLM's watermark detection server: up, one POST /detect, then SIGTERM; its rc is the exit status
# after SIGTERM (uvicorn >= 0.29 re-raises the signal after a clean shutdown: 143).
(cd run && exec python basic/online_serving/watermark_detection_server.py --tokenizer default --key 42 --port 8010) \
  > logs/watermark_server.log 2>&1 &
WPID=$!; start=$(date +%s)
for i in $(seq 1 60); do curl -sf -o /dev/null localhost:8010/docs && break; sleep 1; done
curl -sf localhost:8010/detect -H 'Content-Type: application/json' -d '{"text": "Hello world, a short text."}' \
  >> logs/watermark_server.log
kill -TERM $WPID; wait $WPID; echo "watermark_server rc=$? t=$(( $(date +%s)-start ))s" >> results.txt
runone chat_with_template_arg basic/offline_inference/chat.py --chat-template-path $PYTHONPATH/pagedllm/data/gemma_chat_template.jinja
# vLLM's demo /generate server and its client against it (as client.py's docstring says; not
# against pagedllm serve): the server's rc is its exit status after SIGTERM.
(cd run && exec python applications/api_server/server.py --model default) > logs/api_server_server.log 2>&1 &
APID=$!; start=$(date +%s)
for i in $(seq 1 90); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
TO=120 runone api_server_client applications/api_server/client.py
TO=120 runone api_server_client_stream applications/api_server/client.py --stream --n 2
kill -TERM $APID; for i in $(seq 1 30); do kill -0 $APID 2>/dev/null || break; sleep 1; done
kill -0 $APID 2>/dev/null && kill -KILL $APID
wait $APID; echo "api_server_server rc=$? t=$(( $(date +%s)-start ))s" >> results.txt
# online scripts against pagedllm serve (flags as each example's docstring asks)
export TO=300
serve() {  # name, extra flags...
  local name=$1; shift
  setsid pagedllm serve --chat-template gemma-tools --max-model-len 1024 --port 8000 "$@" > logs/server_$name.log 2>&1 &
  SPID=$!; echo $SPID > server_$name.pid
  for i in $(seq 1 180); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
  echo "server $name up after $((i*2))s" >> results.txt
}
stop() { kill -TERM -- -$SPID; sleep 10; kill -0 $SPID 2>/dev/null && kill -KILL -- -$SPID; sleep 2; }
serve hermes --enable-auto-tool-choice --tool-call-parser hermes --enable-prompt-embeds --enable-scale-out --served-model-name default "$HF"
runone on_chat_client basic/online_serving/openai_chat_completion_client.py
runone on_completion_client basic/online_serving/openai_completion_client.py
runone on_batched_chat generate/batched_chat_completions_online.py
runone on_otel_dummy observability/opentelemetry/dummy_client.py
runone on_structured_client features/structured_outputs/structured_outputs_client.py
runone on_tools tool_calling/openai_chat_completion_client_with_tools.py
runone on_tools_required tool_calling/openai_chat_completion_client_with_tools_required.py
runone on_responses_tools tool_calling/openai_responses_client_with_tools.py
runone on_responses_mcp tool_calling/openai_responses_client_with_mcp_tools.py
runone on_prompt_embed_client features/prompt_embed/prompt_embed_inference_with_openai_client_folder.py
runone on_dp_pause_resume rl/pause_resume/data_parallel_pause_resume.py
runone on_token_gen scale_out/token_generation_client_folder.py
TO=30 runone on_kv_events_sub features/kv_events/kv_events_subscriber.py
stop
serve reasoning --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser deepseek_r1
runone on_reasoning reasoning/openai_chat_completion_with_reasoning.py
runone on_reasoning_stream reasoning/openai_chat_completion_with_reasoning_streaming.py
runone on_reasoning_tools reasoning/openai_chat_completion_tool_calls_with_reasoning.py
runone on_reasoning_responses reasoning/openai_responses_client.py
stop
serve xlam --enable-auto-tool-choice --tool-call-parser xlam
runone on_tools_xlam tool_calling/openai_chat_completion_client_with_tools_xlam.py
runone on_tools_xlam_stream tool_calling/openai_chat_completion_client_with_tools_xlam_streaming.py
stop
echo "ALL DONE $(date -u +%H:%M:%S)" >> results.txt
