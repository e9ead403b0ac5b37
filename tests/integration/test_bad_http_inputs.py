"""The bad-input corpus, server side: HTTP bodies to the embedded engine,
the agent harness and the rollout buffer. The three servers run ONCE for the module, in this
process (one event-loop thread, a tiny qwen2, small body limits so "huge" bodies are cheap).

Each case asserts the HTTP status (4xx, never 500), a one-line message naming the field, that
nothing was recorded (the harness's sessions, the buffer's counters and journal stay as they
were) and that the server still serves (/health) afterwards.

| server  | bad inputs                                                                          | cases  |
|---------|-------------------------------------------------------------------------------------|--------|
| engine  | bad JSON, wrong types, missing fields, out-of-vocab/negative/huge numbers, routes, tokens, 413 | ENGINE |
| harness | messages, sampling fields, session ids, finish bodies, routes, keys, 413            | HARNESS |
| buffer  | trajectories, tasks, leases, batch queries, routes, tokens, 413                      | BUFFER |

The cases test_embedded_engine.py, test_harness.py and test_rollout_buffer.py already hold are not
repeated here.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

ENGINE_TOKEN, HARNESS_KEY, BUFFER_TOKEN = "eng-admin", "harness-key", "buf-token"
LIMIT = 256 * 1024  # every server's body limit here: a "huge" body is LIMIT + 1 KiB
BIG = 2**70


class Raw(bytes):
    """A request body sent as these bytes (not JSON-encoded)."""


HUGE = Raw(b'{"text": "' + b"a" * (LIMIT + 1024) + b'"}')
OK, WRONG, NONE = "ok", "wrong", None  # the bearer sent: the server's own, a wrong one, none

# (id, method, path, body, auth, status, texts the one-line message holds)
ENGINE = [
    ("gen-bad-json", "POST", "/generate", Raw(b"{not json"), OK, 400, ["not valid JSON"]),
    ("gen-truncated-json", "POST", "/generate", Raw(b'{"text": "hi'), OK, 400, ["not valid JSON"]),
    ("gen-binary", "POST", "/generate", Raw(b"\xff\xfe\x00\x01"), OK, 400, ["not valid JSON"]),
    ("gen-empty", "POST", "/generate", Raw(b""), OK, 400, ["body is empty"]),
    ("gen-list-body", "POST", "/generate", [1, 2], OK, 400, ["must be a JSON object"]),
    ("gen-string-body", "POST", "/generate", "hello", OK, 400, ["must be a JSON object"]),
    ("gen-no-input", "POST", "/generate", {"sampling_params": {}}, OK, 400, ["exactly one of 'text' or 'input_ids'"]),
    ("gen-both-inputs", "POST", "/generate", {"text": "a", "input_ids": [1]}, OK, 400, ["exactly one of"]),
    ("gen-text-number", "POST", "/generate", {"text": 5}, OK, 400, ["'text' must be a string"]),
    ("gen-text-list-mixed", "POST", "/generate", {"text": ["a", 5]}, OK, 400, ["'text' must be a string"]),
    ("gen-text-empty-batch", "POST", "/generate", {"text": []}, OK, 400, ["empty batch"]),
    ("gen-ids-string", "POST", "/generate", {"input_ids": "1 2 3"}, OK, 400, ["'input_ids' must be a list of integers"]),
    ("gen-ids-mixed", "POST", "/generate", {"input_ids": [1, "a"]}, OK, 400, ["'input_ids' must be a list of integers"]),
    ("gen-ids-float", "POST", "/generate", {"input_ids": [1.5]}, OK, 400, ["'input_ids' must be a list of integers"]),
    ("gen-ids-bool", "POST", "/generate", {"input_ids": [True]}, OK, 400, ["'input_ids' must be a list of integers"]),
    ("gen-ids-empty", "POST", "/generate", {"input_ids": []}, OK, 400, ["input_ids"]),
    ("gen-ids-negative", "POST", "/generate", {"input_ids": [1, -1]}, OK, 400, ["token id -1", "outside the vocabulary"]),
    ("gen-ids-huge", "POST", "/generate", {"input_ids": [BIG]}, OK, 400, ["outside the vocabulary"]),
    ("gen-ids-out-of-vocab", "POST", "/generate", {"input_ids": [10**6]}, OK, 400, ["token id 1000000"]),
    ("gen-ids-batch-empty-row", "POST", "/generate", {"input_ids": [[1, 2], []]}, OK, 400, ["input_ids"]),
    ("gen-sp-string", "POST", "/generate", {"text": "a", "sampling_params": "greedy"}, OK, 400, ["sampling_params"]),
    ("gen-sp-count", "POST", "/generate", {"text": ["a", "b"], "sampling_params": [{}]}, OK, 400,
     ["1 sampling_params for 2 inputs"]),
    ("gen-sp-unknown", "POST", "/generate", {"text": "a", "sampling_params": {"temprature": 1}}, OK, 400,
     ["unknown sampling parameter 'temprature'"]),
    ("gen-sp-temp-negative", "POST", "/generate", {"text": "a", "sampling_params": {"temperature": -1}}, OK, 400,
     ["temperature"]),
    ("gen-sp-temp-string", "POST", "/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, OK, 400,
     ["temperature"]),
    ("gen-sp-top-p-zero", "POST", "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, OK, 400, ["top_p"]),
    ("gen-sp-top-p-big", "POST", "/generate", {"text": "a", "sampling_params": {"top_p": 7}}, OK, 400, ["top_p"]),
    ("gen-sp-top-k-below", "POST", "/generate", {"text": "a", "sampling_params": {"top_k": -2}}, OK, 400, ["top_k"]),
    ("gen-sp-max-new-negative", "POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -5}}, OK, 400,
     ["max_new_tokens"]),
    ("gen-sp-max-new-huge", "POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": BIG}}, OK, 400,
     ["max_new_tokens"]),
    ("gen-sp-max-new-string", "POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": "10"}}, OK, 400,
     ["max_new_tokens"]),
    ("gen-sp-stop-number", "POST", "/generate", {"text": "a", "sampling_params": {"stop": 5}}, OK, 400, ["stop"]),
    ("gen-sp-unsupported", "POST", "/generate", {"text": "a", "sampling_params": {"repetition_penalty": 2.0}}, OK, 400,
     ["repetition_penalty=2.0 is not supported"]),
    ("gen-logprob-start-string", "POST", "/generate", {"text": "a", "logprob_start_len": "0"}, OK, 400,
     ["logprob_start_len"]),
    ("gen-logprob-start-past", "POST", "/generate", {"input_ids": [1, 2], "return_logprob": True,
                                                    "logprob_start_len": 9}, OK, 400, ["logprob_start_len (9)"]),
    ("gen-top-logprobs-negative", "POST", "/generate", {"text": "a", "top_logprobs_num": -3}, OK, 400,
     ["top_logprobs_num"]),
    ("gen-stream-batch", "POST", "/generate", {"text": ["a", "b"], "stream": True}, OK, 400,
     ["stream=true takes one input"]),
    ("gen-stream-string", "POST", "/generate", {"text": "a", "stream": "yes"}, OK, 400, ["stream must be true or false"]),
    ("gen-huge-body", "POST", "/generate", HUGE, OK, 413, ["larger than the engine's limit"]),
    ("gen-get", "GET", "/generate", None, OK, 405, ["Method Not Allowed"]),
    ("unknown-route", "POST", "/v1/completions", {"prompt": "a"}, OK, 404, ["Not Found"]),
    ("unknown-deep-route", "GET", "/generate/../../etc/passwd", None, OK, 404, ["Not Found"]),
    ("disk-no-token", "POST", "/update_weights_from_disk", {"model_path": "/x"}, NONE, 401, ["admin token"]),
    ("disk-wrong-token", "POST", "/update_weights_from_disk", {"model_path": "/x"}, WRONG, 401, ["admin token"]),
    ("version-no-token", "POST", "/update_weight_version", {"new_version": "9"}, NONE, 401, ["admin token"]),
    ("pause-wrong-token", "POST", "/pause_generation", {}, WRONG, 401, ["admin token"]),
    ("weights-by-name-no-token", "POST", "/get_weights_by_name", {"name": "x"}, NONE, 401, ["admin token"]),
    ("disk-path-number", "POST", "/update_weights_from_disk", {"model_path": 5}, OK, 400, ["model_path"]),
    ("disk-path-missing", "POST", "/update_weights_from_disk", {"model_path": "/nonexistent/model"}, OK, 400,
     ["/nonexistent/model"]),
    ("disk-path-bad-json", "POST", "/update_weights_from_disk", Raw(b"model_path=/x"), OK, 400, ["not valid JSON"]),
    ("disk-path-not-a-model", "POST", "/update_weights_from_disk", {"model_path": "{BADMODEL}"}, OK, 400,
     ["{BADMODEL}"]),
    ("version-number", "POST", "/update_weight_version", {"new_version": 5}, OK, 400, ["new_version"]),
    ("version-empty", "POST", "/update_weight_version", {"new_version": ""}, OK, 400, ["new_version"]),
    ("pause-bad-mode", "POST", "/pause_generation", {"mode": "sideways"}, OK, 400, ["mode 'sideways'"]),
    ("abort-nothing", "POST", "/abort_request", {}, OK, 400, ["'rid'"]),
    ("abort-list-body", "POST", "/abort_request", [1], OK, 400, ["must be a JSON object"]),
    ("weights-by-name-number", "POST", "/get_weights_by_name", {"name": 5}, OK, 400, ["name must be a string"]),
    ("weights-by-name-unknown", "POST", "/get_weights_by_name", {"name": "no.such.weight"}, OK, 400,
     ["Get parameter by name failed"]),
    ("weights-by-name-truncate", "POST", "/get_weights_by_name", {"name": "x", "truncate_size": "all"}, OK, 400,
     ["truncate_size"]),
    ("group-missing-fields", "POST", "/init_weights_update_group", {"group_name": "g"}, OK, 400,
     ["missing or bad field"]),
    ("group-bad-port", "POST", "/init_weights_update_group",
     {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2, "group_name": "g"}, OK, 400,
     ["missing or bad field"]),
    ("dist-outside-update", "POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, OK,
     400, ["between begin_weight_update() and end_weight_update()"]),
    ("destroy-unknown-group", "POST", "/destroy_weights_update_group", {"group_name": "nope"}, OK, 400,
     ["does not exist"]),
    ("gen-lora-unknown", "POST", "/generate", {"input_ids": [1], "lora_path": "nope"}, OK, 400,
     ["lora_path 'nope' is not a loaded LoRA adapter", "POST /load_lora_adapter"]),
    ("gen-lora-count", "POST", "/generate", {"input_ids": [[1], [2]], "lora_path": ["a"]}, OK, 400,
     ["lora_path has 1 entries for 2 inputs"]),
    ("gen-lora-number", "POST", "/generate", {"input_ids": [1], "lora_path": 7}, OK, 400, ["lora_path must be"]),
    ("lora-load-no-path", "POST", "/load_lora_adapter", {"lora_name": "a"}, OK, 400, ["lora_name and lora_path"]),
    ("lora-load-missing-dir", "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent/adapter"},
     OK, 400, ["/nonexistent/adapter", "is not a directory"]),
    ("lora-load-not-an-adapter", "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "{BADMODEL}"}, OK, 400,
     ["no adapter_config.json"]),
    ("lora-load-no-token", "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, NONE, 401,
     ["admin token"]),
    ("lora-unload-unknown", "POST", "/unload_lora_adapter", {"lora_name": "nope"}, OK, 400,
     ["LoRA adapter 'nope' is not loaded"]),
    ("lora-dist-unknown-group", "POST", "/load_lora_adapter_from_distributed", {"lora_name": "a", "group_name": "nope"},
     OK, 400, ["group 'nope' not in", "/init_weights_update_group"]),
]

HARNESS = [
    ("chat-messages-string", "POST", "/v1/chat/completions", {"messages": "hi"}, OK, 400, ["'messages' must be a non-empty list"]),
    ("chat-messages-object", "POST", "/v1/chat/completions", {"messages": {"role": "user"}}, OK, 400, ["'messages'"]),
    ("chat-message-number", "POST", "/v1/chat/completions", {"messages": [5]}, OK, 400, ["messages[0] must be an object"]),
    ("chat-message-no-role", "POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, OK, 400,
     ["messages[0] must be an object with a string 'role'"]),
    ("chat-message-role-number", "POST", "/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, OK, 400,
     ["messages[0]"]),
    ("chat-content-number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, OK, 400,
     ["messages[0].content"]),
    ("chat-content-image", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, OK, 400,
     ["messages[0].content[0]: only text parts"]),
    ("chat-role-unknown", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, OK, 400,
     ["chat template refused"]),
    ("chat-max-tokens-negative", "POST", "/v1/chat/completions", {"messages": "MSG", "max_tokens": -1}, OK, 400,
     ["max_tokens must be a positive integer"]),
    ("chat-max-tokens-string", "POST", "/v1/chat/completions", {"messages": "MSG", "max_tokens": "5"}, OK, 400,
     ["max_tokens"]),
    ("chat-max-tokens-huge", "POST", "/v1/chat/completions", {"messages": "MSG", "max_tokens": BIG}, OK, 400,
     ["max_new_tokens"]),
    ("chat-max-tokens-disagree", "POST", "/v1/chat/completions",
     {"messages": "MSG", "max_tokens": 2, "max_completion_tokens": 3}, OK, 400, ["disagree"]),
    ("chat-temperature-string", "POST", "/v1/chat/completions", {"messages": "MSG", "temperature": "hot"}, OK, 400,
     ["temperature must be a number"]),
    ("chat-temperature-huge", "POST", "/v1/chat/completions", {"messages": "MSG", "temperature": 1e308}, OK, 400,
     ["temperature"]),
    ("chat-top-p-zero", "POST", "/v1/chat/completions", {"messages": "MSG", "top_p": 0}, OK, 400, ["top_p"]),
    ("chat-top-p-bool", "POST", "/v1/chat/completions", {"messages": "MSG", "top_p": True}, OK, 400, ["top_p"]),
    ("chat-stop-number", "POST", "/v1/chat/completions", {"messages": "MSG", "stop": 5}, OK, 400, ["stop must be"]),
    ("chat-stop-empty-string", "POST", "/v1/chat/completions", {"messages": "MSG", "stop": [""]}, OK, 400, ["stop must be"]),
    ("chat-seed-string", "POST", "/v1/chat/completions", {"messages": "MSG", "seed": "x"}, OK, 400, ["seed must be an integer"]),
    ("chat-tools-string", "POST", "/v1/chat/completions", {"messages": "MSG", "tools": "calc"}, OK, 400, ["'tools' must be a list"]),
    ("chat-logprobs-word", "POST", "/v1/chat/completions", {"messages": "MSG", "logprobs": "yes"}, OK, 400,
     ["logprobs must be true or false"]),
    ("chat-stream-options-list", "POST", "/v1/chat/completions", {"messages": "MSG", "stream": True,
                                                                  "stream_options": [1]}, OK, 400, ["stream_options"]),
    ("chat-tool-without-call", "POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "5"}]}, OK,
     400, ["role 'tool' must answer a preceding assistant message"]),
    ("chat-tool-call-bad-arguments", "POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}, OK, 400,
     ["arguments is not valid JSON"]),
    ("chat-response-format", "POST", "/v1/chat/completions", {"messages": "MSG", "response_format": {"type": "json_object"}},
     OK, 400, ["response_format"]),
    ("chat-user-number", "POST", "/v1/chat/completions", {"messages": "MSG", "user": 5, "_no_sid": True}, OK, 400,
     ["'user' must be a string"]),
    ("chat-session-id-long", "POST", "/v1/chat/completions", {"messages": "MSG", "_sid": "s" * 5000}, OK, 400,
     ["session id"]),
    ("chat-session-id-control", "POST", "/v1/chat/completions", {"messages": "MSG", "user": "a\x00b", "_no_sid": True},
     OK, 400, ["session id"]),
    ("chat-list-body", "POST", "/v1/chat/completions", [{"role": "user", "content": "hi"}], OK, 400,
     ["must be a JSON object"]),
    ("chat-empty-body", "POST", "/v1/chat/completions", Raw(b""), OK, 400, ["body is empty"]),
    ("chat-binary-body", "POST", "/v1/chat/completions", Raw(b"\x80\x81"), OK, 400, ["not valid JSON"]),
    ("chat-nan", "POST", "/v1/chat/completions", Raw(b'{"messages": [{"role": "user", "content": "hi"}], '
                                                     b'"temperature": NaN}'), OK, 400, ["temperature"]),
    ("chat-huge-body", "POST", "/v1/chat/completions", HUGE, OK, 413, ["larger than the harness's limit"]),
    ("chat-get", "GET", "/v1/chat/completions", None, OK, 405, ["GET is not allowed"]),
    ("models-wrong-key", "GET", "/v1/models", None, WRONG, 401, ["Incorrect or missing API key"]),
    ("sessions-no-key", "GET", "/sessions", None, NONE, 401, ["Incorrect or missing API key"]),
    ("session-unknown", "GET", "/sessions/nobody", None, OK, 404, ["nobody"]),
    ("finish-reward-string", "POST", "/sessions/real/finish", {"reward": "high"}, OK, 400, ["reward must be a finite number"]),
    ("finish-reward-nan", "POST", "/sessions/real/finish", Raw(b'{"reward": NaN}'), OK, 400, ["reward must be a finite"]),
    ("finish-reward-inf", "POST", "/sessions/real/finish", Raw(b'{"reward": Infinity}'), OK, 400, ["reward"]),
    ("finish-reward-bool", "POST", "/sessions/real/finish", {"reward": True}, OK, 400, ["reward"]),
    ("finish-reward-dict-bad", "POST", "/sessions/real/finish", {"reward": {"acc": "x"}}, OK, 400, ["reward"]),
    ("finish-unknown-field", "POST", "/sessions/real/finish", {"reward": 1, "score": 2}, OK, 400,
     ["unknown finish fields ['score']"]),
    ("finish-label-number", "POST", "/sessions/real/finish", {"label": 5}, OK, 400, ["label must be a string"]),
    ("finish-group-list", "POST", "/sessions/real/finish", {"group": [1]}, OK, 400, ["group must be"]),
    ("finish-metadata-list", "POST", "/sessions/real/finish", {"metadata": [1]}, OK, 400, ["metadata must be a JSON object"]),
    ("finish-metadata-reserved", "POST", "/sessions/real/finish", {"metadata": {"session_id": "x"}}, OK, 400,
     ["written by the harness"]),
    ("finish-list-body", "POST", "/sessions/real/finish", [1], OK, 400, ["must be a JSON object"]),
    ("finish-bad-json", "POST", "/sessions/real/finish", Raw(b"{reward: 1}"), OK, 400, ["not valid JSON"]),
    ("finish-wrong-key", "POST", "/sessions/real/finish", {"reward": 1}, WRONG, 401, ["API key"]),
    ("publish-without-run", "POST", "/publish", {}, OK, 409, ["not attached to a run directory"]),
    ("unknown-route", "POST", "/v1/embeddings", {"input": "a"}, OK, 404, ["no endpoint POST /v1/embeddings"]),
]


def traj(**kw) -> dict:
    d = {"index": 0, "group_index": 0, "tokens": [11, 12, 13, 100, 200, 300], "response_length": 3, "reward": 1.0,
         "rollout_log_probs": [-0.5, -1.0, -0.25], "loss_mask": [1, 1, 1]}
    d.update(kw)
    return d


BUFFER = [
    ("write-nan-reward", "POST", "/buffer/write", Raw(b'{"index": 0, "group_index": 0, "reward": NaN}'), OK, 400,
     ["NaN is not a JSON number"]),
    ("write-string", "POST", "/buffer/write", "a sample", OK, 400, ["send a Sample object"]),
    ("write-number", "POST", "/buffer/write", 5, OK, 400, ["send a Sample object"]),
    ("write-empty-body", "POST", "/buffer/write", Raw(b""), OK, 400, ["Sample"]),
    ("write-trajectories-string", "POST", "/buffer/write", {"trajectories": "x"}, OK, 400, ["trajectories must be a list"]),
    ("write-trajectories-extra", "POST", "/buffer/write", {"trajectories": [], "extra": 1}, OK, 400, ["extra"]),
    ("write-tokens-string", "POST", "/buffer/write", traj(tokens="abc"), OK, 400, ["tokens"]),
    ("write-tokens-negative", "POST", "/buffer/write", traj(tokens=[1, 2, 3, -4, 5, 6]), OK, 400,
     ["tokens must be a non-empty list of non-negative token ids"]),
    ("write-tokens-huge", "POST", "/buffer/write", traj(tokens=[1, 2, 3, BIG, 5, 6]), OK, 400,
     ["token id 1180591620717411303424 is outside the model's vocabulary"]),
    ("write-tokens-empty", "POST", "/buffer/write", traj(tokens=[], response_length=0, rollout_log_probs=[], loss_mask=[]),
     OK, 400, ["tokens"]),
    ("write-response-negative", "POST", "/buffer/write", traj(response_length=-1), OK, 400, ["response_length"]),
    ("write-response-too-long", "POST", "/buffer/write", traj(response_length=99), OK, 400, ["response_length"]),
    ("write-reward-string", "POST", "/buffer/write", traj(reward="high"), OK, 400, ["reward"]),
    ("write-reward-bool", "POST", "/buffer/write", traj(reward=True), OK, 400, ["reward must be a number, not true"]),
    ("write-group-negative", "POST", "/buffer/write", traj(group_index=-3), OK, 400, ["group_index"]),
    ("write-group-float", "POST", "/buffer/write", traj(group_index=1.5), OK, 400, ["group_index"]),
    ("write-group-huge", "POST", "/buffer/write", traj(group_index=BIG), OK, 400, ["group_index"]),
    ("write-index-string", "POST", "/buffer/write", traj(index="a"), OK, 400, ["index"]),
    ("write-index-negative", "POST", "/buffer/write", traj(index=-1), OK, 400, ["index must be >= 0"]),
    ("write-logprobs-short", "POST", "/buffer/write", traj(rollout_log_probs=[-1.0]), OK, 400, ["rollout_log_probs"]),
    ("write-logprobs-positive", "POST", "/buffer/write", traj(rollout_log_probs=[1.0, 2.0, 3.0]), OK, 400,
     ["rollout_log_probs"]),
    ("write-loss-mask-values", "POST", "/buffer/write", traj(loss_mask=[1, 2, 1]), OK, 400, ["loss_mask"]),
    ("write-metadata-list", "POST", "/buffer/write", traj(metadata=[1]), OK, 400, ["metadata"]),
    ("write-status-unknown", "POST", "/buffer/write", traj(status="exploded"), OK, 400, ["status 'exploded' is not one of"]),
    ("write-second-bad", "POST", "/buffer/write", [traj(), traj(index=1, tokens="x")], OK, 400, ["trajectory 1"]),
    ("write-huge-body", "POST", "/buffer/write", HUGE, OK, 413, ["larger than the buffer's limit"]),
    ("write-no-token", "POST", "/buffer/write", traj(), NONE, 401, ["needs the buffer's token"]),
    ("write-wrong-token", "POST", "/buffer/write", traj(), WRONG, 401, ["needs the buffer's token"]),
    ("write-get", "GET", "/buffer/write", None, OK, 405, ["GET is not allowed on /buffer/write"]),
    ("task-list-body", "POST", "/tasks", [1], OK, 400, ["must be a JSON object"]),
    ("task-metadata-string", "POST", "/tasks", {"metadata": "x"}, OK, 400, ["metadata"]),
    ("task-unknown-field", "POST", "/tasks", {"colour": "red"}, OK, 400, ["colour"]),
    ("task-unknown-get", "GET", "/tasks/nope", None, OK, 404, ["nope"]),
    ("task-unknown-write", "POST", "/tasks/nope/trajectories", traj(), OK, 404, ["nope"]),
    ("task-unknown-finish", "POST", "/tasks/nope/finish", None, OK, 404, ["nope"]),
    ("rollout-data-size-zero", "POST", "/get_rollout_data", {"size": 0}, OK, 400, ["size must be an integer >= 1"]),
    ("rollout-data-size-string", "POST", "/get_rollout_data", {"size": "x"}, OK, 400, ["size must be an integer"]),
    ("rollout-data-size-huge", "POST", "/get_rollout_data", {"size": BIG, "min": 1}, OK, 400, ["size must be an integer >= 1"]),
    ("rollout-data-min-above-size", "POST", "/get_rollout_data", {"size": 2, "min": 5}, OK, 400,
     ["min (5) is larger than size (2)"]),
    ("rollout-data-partial-word", "POST", "/get_rollout_data", {"partial": "maybe"}, OK, 400, ["partial must be"]),
    ("rollout-data-unknown", "POST", "/get_rollout_data", {"sise": 2}, OK, 400, ["sise"]),
    ("batch-size-negative", "GET", "/batch?size=-1", None, OK, 400, ["size must be an integer >= 1"]),
    ("batch-partial-word", "GET", "/batch?partial=maybe", None, OK, 400, ["partial must be true or false"]),
    ("ack-empty", "POST", "/ack", {}, OK, 400, ["lease must be the lease id"]),
    ("ack-unknown-lease", "POST", "/ack", {"lease": "nope"}, OK, 404, ["nope"]),
    ("ack-lease-number", "POST", "/ack", {"lease": 5}, OK, 400, ["lease must be the lease id", "got 5"]),
    ("ack-extra-field", "POST", "/ack", {"lease": "x", "force": True}, OK, 400, ["force"]),
    ("release-null-lease", "POST", "/release", {"lease": None}, OK, 400, ["lease must be the lease id"]),
    ("unknown-route", "POST", "/buffer/clear", {}, OK, 404, ["no endpoint /buffer/clear"]),
]


# ---------------------------------------------------------------------------------------------- the servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The engine, the harness (on that engine) and the buffer, served from one event-loop thread."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from slimectl.agents.harness import Harness
    from slimectl.engines.embedded.server import EngineHTTPServer
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.services.buffer_state import RolloutBuffer
    from slimectl.services.rollout_buffer import BufferServer
    from slimectl.engines.pool import EnginePool
    from slimectl.web.server import start_site

    root = tmp_path_factory.mktemp("bad-http")
    model = build_tiny_model("qwen2", root / "model", seed=5)
    bad_model = root / "not-a-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{oops")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bad-inputs-servers", daemon=True)
    thread.start()

    def on_loop(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    engine = EngineHTTPServer(str(model), port=0, weight_version="v0", admin_token=ENGINE_TOKEN, max_body_bytes=LIMIT)
    buffer = RolloutBuffer(root / "buffer", 4, vocab_size=512)

    async def start():
        runners = [await engine.start()]
        pool = EnginePool([engine.url])
        harness = Harness(pool, AutoTokenizer.from_pretrained(model), "tiny", api_key=HARNESS_KEY,
                          out_path=root / "sessions.jsonl", default_max_tokens=2, max_body_bytes=LIMIT)
        h_runner, h_port = await start_site(harness.app, "127.0.0.1", 0)
        bserver = BufferServer(buffer, "127.0.0.1", 0, token=BUFFER_TOKEN, max_body_bytes=LIMIT)
        runners += [h_runner, await bserver.start()]
        return runners, pool, harness, f"http://127.0.0.1:{h_port}", bserver.url

    runners, pool, harness, harness_url, buffer_url = on_loop(start())
    world = {"engine": engine.url, "harness": harness_url, "buffer": buffer_url, "root": root,
             "BADMODEL": str(bad_model), "harness_obj": harness}
    status, out = call(world, "harness", "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "1+1?"}], "_sid": "real"}, OK)
    assert status == 200, out
    try:
        yield world
    finally:
        async def stop():
            for r in runners:
                await r.cleanup()
            await pool.close()
            if harness._tok_thread is not None:
                harness._tok_thread.shutdown(wait=False)

        on_loop(stop())
        engine.shutdown()
        buffer.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert web  # aiohttp imported for the servers


def call(world, server: str, method: str, path: str, body, auth, timeout: float = 60) -> tuple[int, object]:
    """(HTTP status, decoded answer). ``auth``: OK (the server's own bearer), WRONG or NONE."""
    token = {"engine": ENGINE_TOKEN, "harness": HARNESS_KEY, "buffer": BUFFER_TOKEN}[server]
    headers = {"Content-Type": "application/json"}
    if auth == OK:
        headers["Authorization"] = f"Bearer {token}"
    elif auth == WRONG:
        headers["Authorization"] = "Bearer not-the-token"
    if isinstance(body, dict) and server == "harness":
        body = dict(body)
        if body.get("messages") == "MSG":
            body["messages"] = [{"role": "user", "content": "hi"}]
        sid = body.pop("_sid", "bad-inputs")
        if not body.pop("_no_sid", False):
            headers["X-Session-Id"] = sid
    elif server == "harness":
        headers["X-Session-Id"] = "bad-inputs"
    if isinstance(body, Raw):
        data = bytes(body)
    elif body is None:
        data = None
    else:
        data = json.dumps(body).encode()
        for k, v in world.items():
            if isinstance(v, str):
                data = data.replace(f"{{{k}}}".encode(), v.encode())
    req = urllib.request.Request(world[server] + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def message_of(answer) -> str:
    if isinstance(answer, dict):
        if isinstance(answer.get("error"), dict):
            return str(answer["error"].get("message"))
        for key in ("message", "error_message", "detail"):
            if key in answer:
                return str(answer[key])
    return str(answer)


def state_of(world, server: str):
    """What a refused request must not change: the harness's sessions, the buffer's counters and files."""
    if server == "harness":
        return call(world, "harness", "GET", "/sessions", None, OK)[1]
    if server == "buffer":
        stats = call(world, "buffer", "GET", "/stats", None, OK)[1]
        files = sorted((p.name, p.stat().st_size) for p in (world["root"] / "buffer").rglob("*") if p.is_file())
        return {k: stats[k] for k in ("trajectories", "groups", "leases", "tasks")}, files
    return call(world, "engine", "GET", "/get_model_info", None, OK)[1]["weight_version"]


def run_case(world, server: str, method: str, path: str, body, auth, want: int, needles: list[str]) -> None:
    before = state_of(world, server)
    status, answer = call(world, server, method, path, body, auth)
    msg = message_of(answer)
    needles = [n.format(**{k: v for k, v in world.items() if isinstance(v, str)}) for n in needles]
    assert status != 500 and status == want, f"{'traceback' if status >= 500 else 'unclear'}: {status} {answer!r}"[:2000]
    assert "\n" not in msg and all(n in msg for n in needles), f"unclear: {msg!r} lacks {needles}"[:2000]
    health = call(world, server, "GET", "/health", None, OK, timeout=30)[0]
    assert health == 200, f"the {server} no longer serves: /health {health}"
    after = state_of(world, server)
    assert after == before, f"half-written: {before!r} -> {after!r}"[:2000]
    if server == "buffer" and want != 401:  # a refusal is counted (unauthorised ones too, by reason)
        assert call(world, "buffer", "GET", "/stats", None, OK)[1]["rejected"]["total"] >= 1


@pytest.mark.parametrize("cid, method, path, body, auth, status, needles", ENGINE, ids=[c[0] for c in ENGINE])
def test_engine(servers, cid, method, path, body, auth, status, needles):
    run_case(servers, "engine", method, path, body, auth, status, needles)


@pytest.mark.parametrize("cid, method, path, body, auth, status, needles", HARNESS, ids=[c[0] for c in HARNESS])
def test_harness(servers, cid, method, path, body, auth, status, needles):
    run_case(servers, "harness", method, path, body, auth, status, needles)
    if path.startswith("/sessions/real/finish"):
        real = call(servers, "harness", "GET", "/sessions/real", None, OK)[1]
        assert real["finished"] is False, "half-written: a refused finish finished the session"


@pytest.mark.parametrize("cid, method, path, body, auth, status, needles", BUFFER, ids=[c[0] for c in BUFFER])
def test_buffer(servers, cid, method, path, body, auth, status, needles):
    run_case(servers, "buffer", method, path, body, auth, status, needles)


def test_every_server_still_generates_and_stores_after_the_corpus(servers):
    status, out = call(servers, "engine", "POST", "/generate",
                       {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, OK)
    assert status == 200 and len(out["output_ids"]) == 2 and out["meta_info"]["weight_version"] == "v0"
    status, out = call(servers, "harness", "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "2+2?"}], "_sid": "after"}, OK)
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
    status, out = call(servers, "buffer", "POST", "/buffer/write", traj(group_index=7), OK)
    assert status == 200, out


def test_the_corpus_is_large_enough():
    assert len(ENGINE) + len(HARNESS) + len(BUFFER) >= 150
