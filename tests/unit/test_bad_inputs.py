"""The bad-input corpus, CLI side: configs, --set, datasets, HF checkpoints,
run directories. Every case runs `slimectl ARGS` in this process and must end in exit code 2
(usage/config/input) or 1 (runtime), with ONE line ``Error: ...`` that names the file, key or
field, no traceback, no "unexpected X" (an internal error), and nothing half-written: a run
directory holds the same files afterwards (logs/ and configs/STAGE.yaml, the record of the
invocation, excepted), no .staging debris, no lock left; a new run directory is not created.

torch_dist checkpoints (payload pickles, damaged shards, bad trackers) are in
tests/integration/test_checkpoint_safety.py; the servers' HTTP bodies in
tests/integration/test_bad_http_inputs.py.

| group     | what                                                                    | cases |
|-----------|-------------------------------------------------------------------------|-------|
| config    | YAML syntax, non-mapping, unknown keys, types, ranges, contradictions    | CONFIG |
| set       | --set syntax, unknown keys, types, stage sections                        | SET |
| dataset   | missing/empty/non-UTF-8 files, bad JSON lines, keys, types, parquet, slices | DATASET |
| hf        | HF model dirs: config.json, safetensors, index, *.bin pickles           | HF |
| torch_dist| checkpoint roots: slimectl_checkpoint.json, trackers, iterations, export options | CKPT |
| convert   | convert's options                                                       | CONVERT_ARGS |
| rundir    | not a run dir, foreign dir, run.json, config.yaml, extend.json, cursors, locks, READY | RUNDIR |
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------------- the table
# (id, argv with {T} {RUN} {MODEL} {HF} {R:name} placeholders, exit code, texts the one Error line holds)
# Files the argv names are made by the world fixture (config/dataset/model files, run directories).

TRACKER = "latest_checkpointed_iteration.txt"
ARCH = {"family": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_attention_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "qkv_bias": False, "qk_norm": False, "dtype": "fp32"}

CONFIG = [
    # config files given to `init NEW --config FILE`: exit 2 and NEW is not created
    ("yaml-unclosed", "c/unclosed.yaml", "model: [a, b", ["unclosed.yaml line", "invalid YAML"]),
    ("yaml-tab-indent", "c/tab.yaml", "model:\n\tpath: x\n", ["tab.yaml line", "invalid YAML"]),
    ("yaml-bad-mapping", "c/badmap.yaml", "rollout:\n  batch_size: 2\n lr: 3\n", ["badmap.yaml line", "invalid YAML"]),
    ("yaml-duplicate-section", "c/dup.yaml", "rollout:\n  batch_size: 2\nrollout:\n  batch_size: 4\n",
     ["dup.yaml line 3", "duplicate key 'rollout'"]),
    ("yaml-duplicate-key", "c/dupkey.yaml", "train:\n  lr: 0.1\n  lr: 0.2\n", ["dupkey.yaml line 3", "duplicate key 'lr'"]),
    ("yaml-list", "c/list.yaml", "- model\n- rollout\n", ["list.yaml must hold a mapping", "not a list"]),
    ("yaml-scalar", "c/scalar.yaml", "hello\n", ["scalar.yaml must hold a mapping", "not a str"]),
    ("yaml-non-utf8", "c/latin1.yaml", b"name: caf\xe9\n", ["latin1.yaml is not UTF-8"]),
    ("yaml-binary", "c/binary.yaml", b"\x00\x01\x02\xff\xfe", ["binary.yaml"]),
    ("yaml-missing", "c/none.yaml", None, ["config file {T}/c/none.yaml does not exist"]),
    ("yaml-directory", "c/adir.yaml", "DIR", ["{T}/c/adir.yaml", "is a directory"]),
    ("section-scalar", "c/secscalar.yaml", "rollout: 5\n", ["secscalar.yaml", "rollout = 5"]),
    ("section-list", "c/seclist.yaml", "train: [1, 2]\n", ["seclist.yaml", "train = [1, 2]"]),
    ("unknown-section", "c/unksec.yaml", "rolout: {batch_size: 2}\n", ["unknown config key 'rolout'", "did you mean 'rollout'"]),
    ("unknown-key", "c/unkkey.yaml", "rollout: {batch_sise: 2}\n", ["'rollout.batch_sise'", "did you mean 'rollout.batch_size'"]),
    ("unknown-key-far", "c/unkfar.yaml", "train: {zzz: 2}\n", ["unknown config key 'train.zzz'"]),
    ("int-as-word", "c/intword.yaml", "rollout: {batch_size: two}\n", ["rollout.batch_size = \"two\"", "integer"]),
    ("int-as-float", "c/intfloat.yaml", "rollout: {batch_size: 2.5}\n", ["rollout.batch_size = 2.5"]),
    ("int-as-bool", "c/intbool.yaml", "rollout: {batch_size: true}\n", ["rollout.batch_size = true"]),
    ("int-as-list", "c/intlist.yaml", "rollout: {batch_size: [2]}\n", ["rollout.batch_size = [2]"]),
    ("int-zero", "c/intzero.yaml", "rollout: {batch_size: 0}\n", ["rollout.batch_size = 0", "greater than 0"]),
    ("int-negative", "c/intneg.yaml", "rollout: {num_rollout: -3}\n", ["rollout.num_rollout = -3"]),
    ("int-huge-port", "c/port.yaml", "engine: {port: 70000}\n", ["engine.port = 70000"]),
    ("float-word", "c/lrword.yaml", "train: {lr: fast}\n", ["train.lr = \"fast\"", "number"]),
    ("float-negative", "c/lrneg.yaml", "train: {lr: -1.0e-5}\n", ["train.lr = -1e-05"]),
    ("float-inf", "c/lrinf.yaml", "train: {lr: .inf}\n", ["train.lr", "finite"]),
    ("float-nan", "c/nan.yaml", "algorithm: {eps_clip: .nan}\n", ["algorithm.eps_clip"]),
    ("beta-one", "c/beta.yaml", "train: {adam_beta1: 1.0}\n", ["train.adam_beta1 = 1.0", "less than 1"]),
    ("top-p-over", "c/topp.yaml", "rollout: {top_p: 1.5}\n", ["rollout.top_p = 1.5"]),
    ("top-k-below", "c/topk.yaml", "rollout: {top_k: -2}\n", ["rollout.top_k = -2"]),
    ("temperature-negative", "c/temp.yaml", "rollout: {temperature: -0.5}\n", ["rollout.temperature = -0.5"]),
    ("gamma-over", "c/gamma.yaml", "algorithm: {gamma: 1.5}\n", ["algorithm.gamma = 1.5"]),
    ("choice-dtype", "c/dtype.yaml", "model: {dtype: fp8}\n", ["model.dtype = \"fp8\"", "must be one of"]),
    ("choice-estimator", "c/est.yaml", "algorithm: {advantage_estimator: ppo2}\n", ["algorithm.advantage_estimator", "ppo2"]),
    ("choice-kl-type", "c/kltype.yaml", "algorithm: {kl_loss_type: k9}\n", ["algorithm.kl_loss_type", "k9"]),
    ("choice-backend", "c/backend.yaml", "engine: {backend: vllm}\n", ["engine.backend", "vllm"]),
    ("choice-transport", "c/transport.yaml", "sync: {transport: carrier-pigeon}\n", ["sync.transport"]),
    ("choice-progress", "c/progress.yaml", "logging: {progress: maybe}\n", ["logging.progress"]),
    ("list-as-string", "c/stop.yaml", "rollout: {stop: abc}\n", ["rollout.stop = \"abc\""]),
    ("list-bad-items", "c/stopids.yaml", "rollout: {stop_token_ids: [a, 2]}\n", ["rollout.stop_token_ids.0"]),
    ("dict-as-list", "c/evallist.yaml", "data: {eval_data: [a, b]}\n", ["data.eval_data"]),
    ("dict-bad-value", "c/evalval.yaml", "data: {eval_data: {x: 5}}\n", ["data.eval_data.x = 5"]),
    ("bool-as-word", "c/boolword.yaml", "data: {shuffle: sometimes}\n", ["data.shuffle = \"sometimes\""]),
    ("name-as-list", "c/name.yaml", "name: [1, 2]\n", ["name = [1, 2]"]),
    ("config-version", "c/cver.yaml", "config_version: 2\n", ["config_version"]),
    ("min-lr-above-lr", "c/minlr.yaml", "train: {lr: 1.0e-6, min_lr: 1.0e-3}\n", ["train.min_lr", "train.lr"]),
    ("kl-coef-with-grpo", "c/klgrpo.yaml", "algorithm: {kl_coef: 0.1}\n", ["algorithm.kl_coef", "advantage_estimator"]),
    ("unbiased-kl-no-loss", "c/ukl.yaml", "algorithm: {use_unbiased_kl: true}\n", ["algorithm.use_unbiased_kl", "use_kl_loss"]),
    ("tis-low-above-high", "c/tis.yaml", "algorithm: {tis_clip_low: 3, tis_clip: 2}\n", ["algorithm.tis_clip_low", "algorithm.tis_clip"]),
    ("custom-tis-off", "c/ctis.yaml", "algorithm: {custom_tis_function: 'm:f'}\n", ["custom_tis_function", "use_tis"]),
    ("custom-loss-missing", "c/closs.yaml", "algorithm: {loss_type: custom_loss}\n", ["custom_loss_function"]),
    ("eval-pass-k", "c/passk.yaml", "rollout: {eval_pass_k: [8], eval_n_samples: 2}\n", ["rollout.eval_pass_k"]),
    ("model-path-missing", "c/mpath.yaml", "model: {path: nowhere}\n", ["model.path", "nowhere"]),
    ("prompt-data-bad-slice", "c/slice.yaml", "data: {prompt_data: 'x.jsonl@[0:x]'}\n", ["data.prompt_data", "@[0:x]"]),
    ("eval-data-bad-slice", "c/eslice.yaml", "data: {eval_data: {a: 'x.jsonl@[a:b]'}}\n", ["data.eval_data.a", "@[a:b]"]),
]

SET = [
    # (id, argv, code, texts)
    ("set-no-equals", "init {T}/new --set model.path={MODEL} --set train.lr", 2, ["--set 'train.lr'", "KEY=VALUE"]),
    ("set-empty-key", "init {T}/new --set model.path={MODEL} --set =5", 2, ["--set '=5'", "dotted path"]),
    ("set-double-dot", "init {T}/new --set model.path={MODEL} --set train..lr=1", 2, ["train..lr", "dotted path"]),
    ("set-section", "init {T}/new --set model.path={MODEL} --set train=5", 2, ["'train' is a section"]),
    ("set-under-value", "init {T}/new --set model.path={MODEL} --set train.lr.x=1", 2, ["'train.lr' is a value"]),
    ("set-unknown", "init {T}/new --set model.path={MODEL} --set nosuch.key=1", 2, ["unknown config key 'nosuch'"]),
    ("set-typo", "init {T}/new --set model.path={MODEL} --set train.lrr=1", 2, ["'train.lrr'", "did you mean 'train.lr'"]),
    ("set-type", "init {T}/new --set model.path={MODEL} --set train.lr=abc", 2, ["train.lr = \"abc\""]),
    ("set-broken-yaml", "init {T}/new --set model.path={MODEL} --set rollout.batch_size=[1", 2, ["rollout.batch_size"]),
    ("set-range", "init {T}/new --set model.path={MODEL} --set rollout.n_samples_per_prompt=0", 2,
     ["rollout.n_samples_per_prompt = 0"]),
    ("set-choice", "init {T}/new --set model.path={MODEL} --set algorithm.tis_mode=clip", 2, ["algorithm.tis_mode"]),
    ("set-contradiction", "init {T}/new --set model.path={MODEL} --set algorithm.kl_coef=0.1 "
     "--set algorithm.advantage_estimator=reinforce_plus_plus", 2, ["algorithm.kl_coef", "use_kl_loss"]),
    ("set-model-path-file", "init {T}/new --set model.path={T}/c/list.yaml", 2, ["model.path"]),
    ("set-model-path-no-config", "init {T}/new --set model.path={T}/c", 2, ["model.path", "no config.json"]),
    ("set-bad-slice", "init {T}/new --set model.path={MODEL} --set data.prompt_data=x.jsonl@[1:2:3]", 2,
     ["data.prompt_data", "@[1:2:3]"]),
    ("set-eval-missing", "init {T}/new --set model.path={MODEL} --set data.eval_data.a={T}/d/none.jsonl", 2,
     ["data.eval_data.a", "none.jsonl"]),
    ("set-outside-stage-train", "train -r {RUN} --set rollout.batch_size=2", 2, ["slimectl train may only override"]),
    ("set-outside-stage-rollout", "rollout -r {RUN} --set train.lr=1", 2, ["slimectl rollout may only override"]),
    ("set-outside-stage-sync", "sync -r {RUN} --set model.dtype=bf16", 2, ["slimectl sync may only override"]),
    ("set-stage-range", "train -r {RUN} --set train.lr=-1", 2, ["train.lr = -1"]),
    ("set-stage-unknown", "rollout -r {RUN} --set rollout.temprature=1", 2, ["did you mean 'rollout.temperature'"]),
    ("set-stage-no-equals", "serve -r {RUN} --set engine.port", 2, ["--set 'engine.port'"]),
    ("set-stage-contradiction", "train -r {RUN} --set algorithm.use_unbiased_kl=true", 2, ["use_kl_loss"]),
    ("set-stage-dry-run", "train -r {RUN} --dry-run --set train.adam_beta2=2", 2, ["train.adam_beta2 = 2"]),
    ("rl-config-and-bad-set", "rl -c {T}/c/ok.yaml -r {T}/new --set train.lr=x --dry-run", 2, ["train.lr = \"x\""]),
    ("rl-bad-config", "rl -c {T}/c/unkkey.yaml -r {T}/new", 2, ["unkkey.yaml", "rollout.batch_sise"]),
    ("rl-missing-dataset", "rl -c {T}/c/rl-nodata.yaml -r {T}/new", 2, ["{T}/d/none.jsonl", "data.prompt_data"]),
    ("rl-bad-dataset", "rl -c {T}/c/rl-baddata.yaml -r {T}/new", 2, ["badjson.jsonl line 2", "invalid JSON"]),
    ("rl-bad-eval-dataset", "rl -c {T}/c/rl-badeval.yaml -r {T}/new", 2, ["noinput.jsonl", "key 'input'"]),
    ("rl-no-model", "rl -c {T}/c/rl-nomodel.yaml -r {T}/new", 2, ["model.path is not set"]),
    ("rl-set-contradiction", "rl -c {T}/c/ok.yaml -r {T}/new --set algorithm.use_unbiased_kl=true", 2, ["use_kl_loss"]),
    ("rl-into-foreign-dir", "rl -c {T}/c/ok.yaml -r {T}/c", 2, ["{T}/c"]),
]

DATASET = [
    # (id, file under {T}/d (contents; None: absent; DIR: a directory), spec suffix, texts) through
    # `rollout -r RUN --set data.prompt_data={T}/d/FILE` (the run's reward, math, needs a label)
    ("ds-missing", "none.jsonl", None, "", ["prompt dataset {T}/d/none.jsonl does not exist", "data.prompt_data"]),
    ("ds-directory", "adir.jsonl", "DIR", "", ["{T}/d/adir.jsonl"]),
    ("ds-empty", "empty.jsonl", "", "", ["empty.jsonl", "no usable rows"]),
    ("ds-blank-lines", "blank.jsonl", "\n\n   \n", "", ["blank.jsonl", "no usable rows"]),
    ("ds-csv", "rows.csv", "input,label\n1+1,2\n", "", ["rows.csv", "unsupported format '.csv'"]),
    ("ds-no-suffix", "rows", '{"input": "a", "label": "1"}\n', "", ["{T}/d/rows", "unsupported format"]),
    ("ds-non-utf8", "latin1.jsonl", b'{"input": "caf\xe9", "label": "1"}\n', "", ["latin1.jsonl line 1", "not UTF-8"]),
    ("ds-non-utf8-line3", "latin3.jsonl", b'{"input": "a", "label": "1"}\n{"input": "b", "label": "1"}\n\xff\xfe\n',
     "", ["latin3.jsonl line 3", "not UTF-8"]),
    ("ds-bad-json", "badjson.jsonl", '{"input": "a", "label": "1"}\n{"input": "b", label: 1}\n', "",
     ["badjson.jsonl line 2", "invalid JSON"]),
    ("ds-truncated-json", "trunc.jsonl", '{"input": "a", "label": "1"}\n{"input": "b", "lab', "",
     ["trunc.jsonl line 2", "invalid JSON"]),
    ("ds-json-array-file", "array.json", '[\n{"input": "a", "label": "1"}\n]\n', "", ["array.json line 1"]),
    ("ds-utf8-bom", "bom.jsonl", b'\xef\xbb\xbf{"input": "a", "label": "1"}\n', "", ["bom.jsonl line 1"]),
    ("ds-row-list", "rowlist.jsonl", '["a", "1"]\n', "", ["rowlist.jsonl line 1", "expected a JSON object, got list"]),
    ("ds-row-string", "rowstr.jsonl", '"1+1"\n', "", ["rowstr.jsonl line 1", "expected a JSON object, got str"]),
    ("ds-row-number", "rownum.jsonl", '{"input": "a", "label": "1"}\n42\n', "", ["rownum.jsonl line 2", "got int"]),
    ("ds-row-null", "rownull.jsonl", '{"input": "a", "label": "1"}\nnull\n', "", ["rownull.jsonl line 2", "got NoneType"]),
    ("ds-no-input-key", "noinput.jsonl", '{"question": "a", "label": "1"}\n', "",
     ["noinput.jsonl", "key 'input' (data.input_key) is in no row", "question"]),
    ("ds-one-missing-input", "oneinput.jsonl", '{"input": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n', "",
     ["oneinput.jsonl line 2", "missing key 'input'"]),
    ("ds-input-empty", "inempty.jsonl", '{"input": "", "label": "1"}\n', "", ["inempty.jsonl line 1", "non-empty string"]),
    ("ds-input-number", "innum.jsonl", '{"input": 12, "label": "1"}\n', "", ["innum.jsonl line 1", "'input'"]),
    ("ds-input-object", "inobj.jsonl", '{"input": {"text": "a"}, "label": "1"}\n', "", ["inobj.jsonl line 1", "'input'"]),
    ("ds-input-null", "innull.jsonl", '{"input": null, "label": "1"}\n', "", ["innull.jsonl line 1", "'input'"]),
    ("ds-messages-no-role", "norole.jsonl", '{"input": [{"content": "a"}], "label": "1"}\n', "",
     ["norole.jsonl line 1", "'role' and 'content'"]),
    ("ds-messages-not-dicts", "msgstr.jsonl", '{"input": ["hi"], "label": "1"}\n', "", ["msgstr.jsonl line 1", "'role'"]),
    ("ds-no-label-key", "nolabel.jsonl", '{"input": "a", "answer": "1"}\n', "",
     ["nolabel.jsonl", "key 'label' (data.label_key) is in no row", "'math'"]),
    ("ds-label-all-null", "labelnull.jsonl", '{"input": "a", "label": null}\n', "", ["labelnull.jsonl", "null in every row"]),
    ("ds-one-missing-label", "onelabel.jsonl", '{"input": "a", "label": "1"}\n{"input": "b"}\n', "",
     ["onelabel.jsonl line 2", "no 'label'"]),
    ("ds-metadata-list", "metalist.jsonl", '{"input": "a", "label": "1", "metadata": [1]}\n', "",
     ["metalist.jsonl line 1", "'metadata' must be an object"]),
    ("ds-metadata-number", "metanum.jsonl", '{"input": "a", "label": "1", "metadata": 5}\n', "",
     ["metanum.jsonl line 1", "'metadata' must be an object"]),
    ("ds-metadata-bad-json-string", "metastr.jsonl", '{"input": "a", "label": "1", "metadata": "{oops"}\n', "",
     ["metastr.jsonl line 1", "metadata"]),
    ("ds-metadata-json-list-string", "metajl.jsonl", '{"input": "a", "label": "1", "metadata": "[1, 2]"}\n', "",
     ["metajl.jsonl line 1", "'metadata' must be an object"]),
    ("ds-parquet-garbage", "garbage.parquet", b"PAR1 this is not a parquet file at all", "",
     ["garbage.parquet is not a readable parquet file"]),
    ("ds-parquet-empty-file", "zero.parquet", b"", "", ["zero.parquet is not a readable parquet file"]),
    ("ds-parquet-jsonl-inside", "jsonl.parquet", '{"input": "a", "label": "1"}\n', "", ["jsonl.parquet is not a readable"]),
    ("ds-parquet-no-input", "noinput.parquet", "PARQUET:question", "", ["noinput.parquet", "key 'input'", "question"]),
    ("ds-parquet-input-int", "inint.parquet", "PARQUET:int", "", ["inint.parquet row 1", "'input'"]),
    ("ds-parquet-no-rows", "norows.parquet", "PARQUET:empty", "", ["norows.parquet", "no usable rows"]),
    ("ds-slice-word", "ok.jsonl", "OK", "@[0:x]", ["data.prompt_data", "@[0:x]", "fix the slice"]),
    ("ds-slice-step", "ok.jsonl", "OK", "@[0:2:1]", ["data.prompt_data", "@[0:2:1]"]),
    ("ds-slice-empty-range", "ok.jsonl", "OK", "@[5:2]", ["data.prompt_data", "@[5:2] selects no rows", "fix the slice"]),
    ("ds-slice-past-end", "ok.jsonl", "OK", "@[100:200]", ["@[100:200] selects no rows", "(2 rows)"]),
    ("ds-slice-float", "ok.jsonl", "OK", "@[0.5:1]", ["@[0.5:1]"]),
    ("ds-slice-blank", "ok.jsonl", "OK", "@[]", ["@[]"]),
    ("ds-slice-on-missing", "none.jsonl", None, "@[0:1]", ["none.jsonl does not exist"]),
]

HF = [
    # (id, how the tiny llama's directory is damaged, texts) through `convert --hf DIR --out {T}/o-ID`:
    # exit 1 for a damaged model directory, as tests/unit/test_convert_errors.py has it (2: no model
    # directory at all); the cases test_convert_errors.py already has (shape mismatch, unsupported configs, truncated
    # shard, *.bin only, a missing tensor) are not repeated here.
    ("hf-path-is-file", "file", ["{T}/hf/hf-path-is-file"]),  # exit 2: not a model directory at all
    ("hf-config-not-json", "config:{not json", ["config.json"]),
    ("hf-config-list", "config:[1, 2]", ["config.json"]),
    ("hf-config-empty", "config:", ["config.json"]),
    ("hf-config-non-utf8", "configbytes", ["config.json"]),
    # exit 2: a readable config whose values the architecture check refuses (UnsupportedModel is a usage error)
    ("hf-config-no-model-type", "drop:model_type", ["config.json", "model_type"]),
    ("hf-config-no-hidden-size", "drop:hidden_size", ["config.json", "hidden_size"]),
    ("hf-config-string-size", "set:hidden_size=\"64\"", ["config.json", "hidden_size"]),
    ("hf-config-negative-layers", "set:num_hidden_layers=-1", ["config.json", "num_hidden_layers"]),
    ("hf-config-zero-heads", "set:num_attention_heads=0", ["config.json", "num_attention_heads"]),
    ("hf-no-weights", "rm:model.safetensors", ["safetensors"]),
    ("hf-safetensors-zero-bytes", "bytes:", ["model.safetensors"]),
    ("hf-safetensors-garbage", "bytes:garbage garbage garbage", ["model.safetensors"]),
    ("hf-safetensors-huge-header", "hugeheader", ["model.safetensors"]),
    ("hf-safetensors-header-not-json", "badheader", ["model.safetensors"]),
    ("hf-bin-beside-nothing", "bin", ["hf-bin-beside-nothing holds only pickle weights"]),
    ("hf-index-missing-shard", "index:missing", ["model-00002-of-00002.safetensors"]),
    ("hf-index-not-json", "index:garbage", ["model.safetensors.index.json"]),
    ("hf-index-no-weight-map", "index:nomap", ["model.safetensors.index.json"]),
    ("hf-dtype-int", "intweights", ["hf-dtype-int: tensor model.embed_tokens.weight is int32, not floating point"]),
]


CKPT = [
    # (id, the checkpoint root's files (name -> content; DIR: a directory), export options, exit code, texts)
    # through `export --checkpoint {T}/ck/ID --out {T}/o-ID`. Only what fails before Megatron starts:
    # payload pickles and damaged shards, .metadata and trackers are in test_checkpoint_safety.py.
    ("ck-is-a-file", "FILE", "", 2, ["{T}/ck/ck-is-a-file' is a file"]),
    ("ck-meta-garbage", {"slimectl_checkpoint.json": "{oops"}, "", 1, ["slimectl_checkpoint.json is not valid JSON"]),
    ("ck-meta-non-utf8", {"slimectl_checkpoint.json": b'{"arch": "\xff"}'}, "", 1, ["slimectl_checkpoint.json is not UTF-8"]),
    ("ck-meta-list", {"slimectl_checkpoint.json": "[1, 2]", "state/metadata.json": "{}"}, "", 1,
     ["slimectl_checkpoint.json does not hold a JSON object"]),
    ("ck-meta-no-arch", {"slimectl_checkpoint.json": "{}", TRACKER: "release", "release/metadata.json": "{}"}, "", 1,
     ["slimectl_checkpoint.json", "'arch'"]),
    ("ck-meta-bad-arch", {"slimectl_checkpoint.json": '{"arch": {"family": "llama", "colour": 1}}', TRACKER: "release",
                          "release/metadata.json": "{}"}, "", 1, ["slimectl_checkpoint.json", "arch"]),
    ("ck-meta-arch-list", {"slimectl_checkpoint.json": '{"arch": [1]}', TRACKER: "release",
                           "release/metadata.json": "{}"}, "", 1, ["slimectl_checkpoint.json", "arch"]),
    ("ck-no-tracker", {"slimectl_checkpoint.json": "{}", "release": "DIR"}, "", 2,
     ["has no latest_checkpointed_iteration.txt", "--iteration N"]),
    ("ck-tracker-empty", {"slimectl_checkpoint.json": "{}", TRACKER: ""}, "", 1, ["latest_checkpointed_iteration.txt holds ''"]),
    ("ck-tracker-negative", {"slimectl_checkpoint.json": "{}", TRACKER: "-3"}, "", 1, ["holds '-3'"]),
    ("ck-tracker-missing-iteration", {"slimectl_checkpoint.json": "{}", TRACKER: "7"}, "", 2,
     ["iter_0000007 is not a complete torch_dist checkpoint", "iterations present: none"]),
    ("ck-release-without-metadata", {"slimectl_checkpoint.json": "{}", TRACKER: "release", "release": "DIR"}, "", 2,
     ["release is not a complete torch_dist checkpoint"]),
    ("ck-iteration-absent", {"slimectl_checkpoint.json": "{}", TRACKER: "release", "release/metadata.json": "{}"},
     "--iteration 5", 2, ["iter_0000005 is not a complete", "iterations present: release"]),
    ("ck-train-state-incomplete", {"slimectl_checkpoint.json": '{"iteration": 3}', "state": "DIR"}, "", 1,
     ["state is not a complete torch_dist checkpoint"]),
    ("ck-train-other-iteration", {"slimectl_checkpoint.json": '{"iteration": 3}', "state": "DIR"}, "--iteration 4", 2,
     ["holds iteration 3 only"]),
    ("ck-dtype", {"slimectl_checkpoint.json": "{}"}, "--dtype fp8", 2, ["'--dtype'", "'fp8' is not one of"]),
    ("ck-shard-size-zero", {"slimectl_checkpoint.json": "{}"}, "--max-shard-size 0", 2, ["--max-shard-size"]),
    ("ck-shard-size-negative", {"slimectl_checkpoint.json": "{}"}, "--max-shard-size -5GB", 2, ["--max-shard-size"]),
    ("ck-out-not-empty", {"slimectl_checkpoint.json": json.dumps({"arch": ARCH}), TRACKER: "release",
                          "release/metadata.json": "{}"},
     "OUT={T}/c", 2, ["{T}/c", "--force"]),
]

CONVERT_ARGS = [
    # (id, argv, exit code, texts): convert's own options, on the clean tiny llama
    ("cv-tp-zero", "convert --hf {T}/hf-clean --out {T}/o-cv --tp 0", 2, ["--tp"]),
    ("cv-pp-word", "convert --hf {T}/hf-clean --out {T}/o-cv --pp two", 2, ["--pp"]),
    ("cv-dtype", "convert --hf {T}/hf-clean --out {T}/o-cv --dtype fp8", 2, ["'--dtype'", "'fp8' is not one of"]),
    ("cv-out-is-file", "convert --hf {T}/hf-clean --out {T}/c/list.yaml", 2, ["{T}/c/list.yaml"]),
    ("cv-no-out", "convert --hf {T}/hf-clean", 2, ["--out"]),
    ("cv-into-foreign-run", "convert --hf {T}/hf-clean -r {T}/c", 2, ["{T}/c is not a slimectl run directory"]),
]


RUNDIR = [
    # (id, run directory made by RUNS[id] (or a placeholder path), argv with {R} for it, code, texts)
    ("rd-missing", "{T}/nope", "status -r {R}", 2, ["run directory {T}/nope does not exist"]),
    ("rd-file", "{T}/c/list.yaml", "status -r {R}", 2, ["{T}/c/list.yaml"]),
    ("rd-empty-dir", "{T}/emptydir", "rollout -r {R}", 2, ["{T}/emptydir is not a slimectl run directory"]),
    ("rd-foreign-dir", "{T}/c", "train -r {R}", 2, ["{T}/c is not a slimectl run directory"]),
    ("rd-init-into-foreign", "{T}/c", "init {R} --set model.path={MODEL}", 2, ["is not empty and not a slimectl run"]),
    ("rd-init-into-file", "{T}/c/list.yaml", "init {R} --set model.path={MODEL}", 2, ["{T}/c/list.yaml"]),
    ("rd-run-json-garbage", "run-json-garbage", "status -r {R}", 1, ["run.json is not valid JSON"]),
    ("rd-run-json-empty", "run-json-empty", "status -r {R}", 1, ["run.json"]),
    ("rd-run-json-list", "run-json-list", "train -r {R}", 1, ["run.json is corrupted (not an object)"]),
    ("rd-run-json-foreign", "run-json-foreign", "rollout -r {R}", 1, ["run.json is not a slimectl-run-directory file"]),
    ("rd-run-json-version-str", "run-json-version-str", "status -r {R}", 1, ["run-directory contract v"]),
    ("rd-run-json-newer", "run-json-newer", "sync -r {R}", 1, ["upgrade slimectl"]),
    ("rd-run-json-binary", "run-json-binary", "status -r {R}", 1, ["run.json"]),
    ("rd-config-missing", "config-missing", "train -r {R}", 1, ["config.yaml is missing"]),
    ("rd-config-edited", "config-edited", "rollout -r {R}", 2, ["config.yaml was edited by hand"]),
    ("rd-config-bad-yaml", "config-bad-yaml", "train -r {R}", 2, ["config.yaml line", "invalid YAML"]),
    ("rd-config-unknown-key", "config-unknown-key", "sync -r {R}", 2, ["config.yaml", "unknown config key 'train.nope'"]),
    ("rd-config-bad-value", "config-bad-value", "serve -r {R}", 2, ["config.yaml", "train.lr = \"fast\""]),
    ("rd-config-empty", "config-empty", "train -r {R}", 2, ["config.yaml"]),
    ("rd-config-list", "config-list", "status -r {R}", 0, ["config     ERROR:", "config.yaml must hold a mapping"]),
    ("rd-status-config-bad-yaml", "config-bad-yaml", "status -r {R}", 0, ["config     ERROR:", "invalid YAML"]),
    ("rd-status-config-edited", "config-edited", "status -r {R}", 0, ["config     ERROR:", "edited by hand"]),
    ("rd-extend-garbage", "extend-garbage", "rollout -r {R}", 2, ["extend.json is unreadable"]),
    ("rd-extend-zero", "extend-zero", "train -r {R}", 2, ["extend.json has no valid num_rollout"]),
    ("rd-extend-string", "extend-string", "rollout -r {R}", 2, ["extend.json has no valid num_rollout"]),
    ("rd-extend-list", "extend-list", "train -r {R}", 2, ["extend.json has no valid num_rollout"]),
    ("rd-extend-bool", "extend-bool", "rollout -r {R}", 2, ["extend.json has no valid num_rollout"]),
    ("rd-extend-cmd-garbage", "extend-garbage", "extend -r {R} --num-rollout 20", 2, ["extend.json"]),
    ("rd-status-extend-garbage", "extend-garbage", "status -r {R}", 0, ["config     ERROR:", "extend.json is unreadable"]),
    ("rd-status-extend-zero", "extend-zero", "status -r {R}", 0, ["config     ERROR:", "extend.json has no valid"]),
    ("rd-cursor-garbage", "cursor-garbage", "status -r {R}", 1, ["cursors/train.json"]),
    ("rd-cursor-list", "cursor-list", "status -r {R}", 1, ["cursors/train.json"]),
    ("rd-cursor-negative", "cursor-negative", "status -r {R}", 1, ["cursors/train.json"]),
    ("rd-cursor-consumed-str", "cursor-consumed-str", "status -r {R}", 1, ["cursors/train.json"]),
    ("rd-cursor-foreign", "cursor-foreign", "status -r {R}", 1, ["cursors/train.json"]),
    ("rd-lock-empty", "lock-empty", "rollout -r {R} --set data.prompt_data={T}/d/none.jsonl", 1,
     ["locks/rollout.lock holds no lock record", "delete it"]),
    ("rd-lock-garbage", "lock-garbage", "rollout -r {R} --set data.prompt_data={T}/d/none.jsonl", 1,
     ["locks/rollout.lock holds no lock record"]),
    ("rd-lock-held-live", "lock-live", "rollout -r {R} --set data.prompt_data={T}/d/ok.jsonl", 1, ["rollout", "already running"]),
    ("rd-ready-garbage", "ready-garbage", "sync -r {R} --version 0", 1, ["weights/000000", "READY"]),
    ("rd-ready-list", "ready-list", "sync -r {R} --version 0", 1, ["READY does not hold a manifest object"]),
    ("rd-ready-checksum", "ready-checksum", "sync -r {R} --version 0", 1, ["READY", "checksum"]),
    ("rd-ready-missing-file", "ready-missing-file", "sync -r {R} --version 0", 1, ["weights/000000", "listed in READY is missing"]),
    ("rd-ready-resized-file", "ready-resized-file", "sync -r {R} --version 0", 1, ["weights/000000", "READY says"]),
    ("rd-sync-negative-version", "{RUN}", "sync -r {R} --version -1", 2, ["--version"]),
    ("rd-rollout-negative-id", "{RUN}", "rollout -r {R} --id -1", 2, ["--id"]),
    ("rd-rollout-past-end", "{RUN}", "rollout -r {R} --id 99 --set data.prompt_data={T}/d/ok.jsonl", 2,
     ["rollout 99 is past the run's end"]),
    ("rd-extend-zero-arg", "{RUN}", "extend -r {R} --num-rollout 0", 2, ["--num-rollout"]),
    ("rd-extend-word-arg", "{RUN}", "extend -r {R} --num-rollout many", 2, ["--num-rollout"]),
    ("rd-export-missing-ckpt", "{RUN}", "export -r {R} --checkpoint 7 --out {T}/exp", 2, ["checkpoint"]),
    ("rd-plot-nothing", "{RUN}", "plot -r {R}", 1, ["has no rollout metrics yet"]),
    ("rd-model-without-tokenizer", "{RUN}", "rollout -r {R} --set data.prompt_data={T}/d/ok.jsonl", 2,
     ["model.path = {MODEL}: cannot load a tokenizer"]),
]


# ---------------------------------------------------------------------------------------------- the world


def _write(p: Path, content) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        return
    if content == "DIR":
        p.mkdir(exist_ok=True)
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)


def _parquet(p: Path, kind: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = {"question": pa.table({"question": ["1+1"], "label": ["2"]}),
             "int": pa.table({"input": [12], "label": ["2"]}),
             "empty": pa.table({"input": pa.array([], pa.string()), "label": pa.array([], pa.string())})}[kind]
    pq.write_table(table, p)


def _damage_hf(d: Path, how: str) -> None:
    cfg_path = d / "config.json"
    kind, _, arg = how.partition(":")
    if kind == "file":
        shutil.rmtree(d)
        d.write_text("not a directory")
    elif kind == "config":
        cfg_path.write_text(arg)
    elif kind == "configbytes":
        cfg_path.write_bytes(b'{"model_type": "ll\xe9ama"}')
    elif kind in ("drop", "set"):
        cfg = json.loads(cfg_path.read_text())
        if kind == "drop":
            cfg.pop(arg)
        else:
            k, v = arg.split("=", 1)
            cfg[k] = json.loads(v)
        cfg_path.write_text(json.dumps(cfg))
    elif kind == "rm":
        (d / arg).unlink()
    elif kind == "bytes":
        (d / "model.safetensors").write_bytes(arg.encode())
    elif kind == "hugeheader":
        (d / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    elif kind == "badheader":
        (d / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"{not json}")
    elif kind == "bin":
        import torch

        (d / "model.safetensors").unlink()
        torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    elif kind == "index":
        st = d / "model.safetensors"
        if arg == "missing":
            from safetensors.torch import load_file

            names = list(load_file(str(st)))
            st.rename(d / "model-00001-of-00002.safetensors")
            wm = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
            (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        elif arg == "garbage":
            st.rename(d / "model-00001-of-00001.safetensors")
            (d / "model.safetensors.index.json").write_text("{oops")
        elif arg == "nomap":
            st.rename(d / "model-00001-of-00001.safetensors")
            (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    elif kind == "intweights":
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "model.safetensors"))
        save_file({k: v.to(__import__("torch").int32) for k, v in sd.items()}, str(d / "model.safetensors"))
    else:
        raise AssertionError(how)


def _ready_edit(run: Path, how: str) -> None:
    """Publish weights/000000 (two small files), then damage it."""
    from slimectl.contract.rundir import RunDir

    r = RunDir.open(run)
    with r.weights.publish(0) as d:
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"x" * 64)
    art = run / "weights" / "000000"
    ready = art / "READY"
    if how == "garbage":
        ready.write_text("{half a manif")
    elif how == "list":
        ready.write_text("[]")
    elif how == "checksum":
        m = json.loads(ready.read_text())
        first = next(iter(m["files"]))
        m["files"][first]["size"] = m["files"][first]["size"] + 1
        ready.write_text(json.dumps(m))
    elif how == "missing-file":
        (art / "model.safetensors").unlink()
    elif how == "resized-file":
        (art / "model.safetensors").write_bytes(b"x" * 65)


RUNS = {
    "run-json-garbage": lambda r: (r / "run.json").write_text("{not json"),
    "run-json-empty": lambda r: (r / "run.json").write_text(""),
    "run-json-list": lambda r: (r / "run.json").write_text("[1, 2]"),
    "run-json-foreign": lambda r: (r / "run.json").write_text(json.dumps({"contract": "something-else"})),
    "run-json-version-str": lambda r: (r / "run.json").write_text(json.dumps(
        {**json.loads((r / "run.json").read_text()), "contract_version": "1"})),
    "run-json-newer": lambda r: (r / "run.json").write_text(json.dumps(
        {**json.loads((r / "run.json").read_text()), "contract_version": 99})),
    "run-json-binary": lambda r: (r / "run.json").write_bytes(b"\xff\xfe\x00garbage"),
    "config-missing": lambda r: (r / "config.yaml").unlink(),
    "config-edited": lambda r: (r / "config.yaml").write_text((r / "config.yaml").read_text().replace("lr: ", "lr: 0.5 #")),
    "config-bad-yaml": lambda r: (r / "config.yaml").write_text("train: [unclosed\n"),
    "config-unknown-key": lambda r: (r / "config.yaml").write_text("train:\n  nope: 1\n"),
    "config-bad-value": lambda r: (r / "config.yaml").write_text("train:\n  lr: fast\n"),
    "config-empty": lambda r: (r / "config.yaml").write_text(""),
    "config-list": lambda r: (r / "config.yaml").write_text("- 1\n- 2\n"),
    "extend-garbage": lambda r: (r / "extend.json").write_text("{num_rollout: 20"),
    "extend-zero": lambda r: (r / "extend.json").write_text(json.dumps({"num_rollout": 0})),
    "extend-string": lambda r: (r / "extend.json").write_text(json.dumps({"num_rollout": "20"})),
    "extend-list": lambda r: (r / "extend.json").write_text("[20]"),
    "extend-bool": lambda r: (r / "extend.json").write_text(json.dumps({"num_rollout": True})),
    "cursor-garbage": lambda r: (r / "cursors" / "train.json").write_text("{garbage"),
    "cursor-list": lambda r: (r / "cursors" / "train.json").write_text("[0, 1]"),
    "cursor-negative": lambda r: (r / "cursors" / "train.json").write_text(json.dumps(
        {"consumer": "train", "source": "rollouts", "next": -4, "consumed": []})),
    "cursor-consumed-str": lambda r: (r / "cursors" / "train.json").write_text(json.dumps(
        {"consumer": "train", "source": "rollouts", "next": 1, "consumed": "0"})),
    "cursor-foreign": lambda r: (r / "cursors" / "train.json").write_text(json.dumps(
        {"consumer": "sync", "source": "weights", "next": 0, "consumed": []})),
    "lock-empty": lambda r: (r / "locks" / "rollout.lock").write_text(""),
    "lock-garbage": lambda r: (r / "locks" / "rollout.lock").write_bytes(b"\x00\xffgarbage"),
    "lock-live": lambda r: (r / "locks" / "rollout.lock").write_text(json.dumps(_live_lock_record())),
    "ready-garbage": lambda r: _ready_edit(r, "garbage"),
    "ready-list": lambda r: _ready_edit(r, "list"),
    "ready-checksum": lambda r: _ready_edit(r, "checksum"),
    "ready-missing-file": lambda r: _ready_edit(r, "missing-file"),
    "ready-resized-file": lambda r: _ready_edit(r, "resized-file"),
}


def _live_lock_record() -> dict:
    """A lock record of this (live) process, as the lock code writes it."""
    from slimectl.contract.rundir import locks

    return {"stage": "rollout", "host": locks.hostname(), "host_id": locks.host_id(), "pid": os.getpid(),
            "create_time": locks.process_create_time(), "token": "t", "acquired": "now"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.stages.init import init_run

    t = tmp_path_factory.mktemp("bad-inputs")
    model = t / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for _, name, content, _ in CONFIG:
        _write(t / name, content)
    _write(t / "c" / "ok.yaml", f"model: {{path: {model}}}\n")
    _write(t / "c" / "rl-nodata.yaml", f"model: {{path: {model}}}\ndata: {{prompt_data: {t}/d/none.jsonl}}\n")
    _write(t / "c" / "rl-baddata.yaml", f"model: {{path: {model}}}\ndata: {{prompt_data: {t}/d/badjson.jsonl}}\n")
    _write(t / "c" / "rl-badeval.yaml", f"model: {{path: {model}}}\ndata: {{prompt_data: {t}/d/ok.jsonl, "
                                        f"eval_data: {{arith: {t}/d/noinput.jsonl}}}}\n")
    _write(t / "c" / "rl-nomodel.yaml", f"data: {{prompt_data: {t}/d/ok.jsonl}}\n")
    (t / "emptydir").mkdir()
    for _, name, content, _, _ in DATASET:
        if content == "OK":
            content = '{"input": "a", "label": "1"}\n{"input": "b", "label": "2"}\n'
        if isinstance(content, str) and content.startswith("PARQUET:"):
            (t / "d").mkdir(exist_ok=True)
            _parquet(t / "d" / name, content.split(":", 1)[1])
            continue
        _write(t / "d" / name, content)
    hf = build_tiny_model("llama", t / "hf-clean")
    for cid, how, _ in HF:
        shutil.copytree(hf, t / "hf" / cid)
        _damage_hf(t / "hf" / cid, how)
    for cid, files, _, _, _ in CKPT:
        d = t / "ck" / cid
        if files == "FILE":
            _write(d, "not a directory")
            continue
        d.mkdir(parents=True)
        for name, content in files.items():
            _write(d / name, content)
    run = str(init_run(t / "run", overrides=[f"model.path={model}"]).run.path)
    runs = {}
    for name, damage in RUNS.items():
        path = init_run(t / "runs" / name, overrides=[f"model.path={model}"]).run.path
        damage(path)
        runs[name] = str(path)
    return {"T": str(t), "RUN": str(run), "MODEL": str(model), "runs": runs}


# ---------------------------------------------------------------------------------------------- the checks

SKIP_DIRS = ("logs", "configs")  # the invocation's log and its effective config are records, not half-writes


def snapshot(root: Path) -> dict[str, int] | None:
    if not root.is_dir():
        return None
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in SKIP_DIRS:
            continue
        out[str(rel)] = p.stat().st_size if p.is_file() else -1
    return out


def invoke(argv: list[str]):
    """`slimectl ARGV` in this process: (exit code, output, escaped exception or None)."""
    from click.testing import CliRunner

    from slimectl.commands.cli import cli
    from tests.helpers import in_process_stage

    with in_process_stage():
        res = CliRunner().invoke(cli, argv, prog_name="slimectl", catch_exceptions=True)
    exc = res.exception if res.exception is not None and not isinstance(res.exception, SystemExit) else None
    return res.exit_code, res.output, exc


def verdict(code: int, out: str, exc, want_code: int, needles: list[str], before, after, created: Path | None) -> str:
    """clear, or what is wrong: traceback / silent / half-written / unclear (with why)."""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    if exc is not None or "Traceback" in out or any(ln.startswith("Error: unexpected ") for ln in lines):
        return f"traceback: {exc!r}"
    if created is not None and created.exists():
        return f"half-written: {created} was created"
    if before != after:
        new = sorted(set(after or {}) - set(before or {}))
        changed = sorted(k for k in set(after or {}) & set(before or {}) if after[k] != before[k])
        gone = sorted(set(before or {}) - set(after or {}))
        return f"half-written: new {new} changed {changed} gone {gone}"
    if want_code == 0:  # `status` reports a damaged run directory on its lines and exits 0
        if code != 0 or not any(all(n in ln for n in needles) for ln in lines):
            return f"silent: exit {code}, no line holds {needles}"
        return "clear"
    if code == 0:
        return "silent: exit 0"
    if code != want_code:
        return f"unclear: exit {code}, expected {want_code}"
    if not lines or not lines[-1].startswith("Error: "):
        return "unclear: the last line is not one Error: line"
    missing = [n for n in needles if n not in lines[-1]]
    if missing:
        return f"unclear: the line lacks {missing}"
    return "clear"


def run_case(world, argv: str, want_code: int, needles: list[str], run: str | None, new: str | None = None):
    fmt = {k: v for k, v in world.items() if isinstance(v, str)}
    args = argv.format(**fmt).split()
    needles = [n.format(**fmt) for n in needles]
    run_path = Path(run.format(**fmt)) if run else None
    created = Path(new.format(**fmt)) if new else None
    before = snapshot(run_path) if run_path else None
    code, out, exc = invoke(args)
    after = snapshot(run_path) if run_path else None
    if run_path is not None and (run_path / ".staging").is_dir():
        assert not any((run_path / ".staging").iterdir()), "half-written: .staging debris"
    v = verdict(code, out, exc, want_code, needles, before, after, created)
    if created is not None and created.exists():
        shutil.rmtree(created, ignore_errors=True)
    assert v == "clear", f"{v}\n$ slimectl {' '.join(args)}\n{out}"


@pytest.mark.parametrize("cid, name, content, needles", CONFIG, ids=[c[0] for c in CONFIG])
def test_config_file(world, cid, name, content, needles):
    run_case(world, f"init {{T}}/new --config {{T}}/{name}", 2, needles, None, new="{T}/new")


@pytest.mark.parametrize("cid, argv, code, needles", SET, ids=[c[0] for c in SET])
def test_set(world, cid, argv, code, needles):
    run_case(world, argv, code, needles, None if argv.startswith(("init", "rl")) else "{RUN}", new="{T}/new")


@pytest.mark.parametrize("cid, name, content, spec, needles", DATASET, ids=[c[0] for c in DATASET])
def test_dataset(world, cid, name, content, spec, needles):
    run_case(world, f"rollout -r {{RUN}} --set data.prompt_data={{T}}/d/{name}{spec}", 2, needles, "{RUN}")


REFUSED_CONFIGS = {"hf-config-no-model-type", "hf-config-no-hidden-size", "hf-config-string-size",
                   "hf-config-negative-layers", "hf-config-zero-heads"}
"""The cases exiting 2: configs that parse but that the architecture check refuses (bad input, not damage)."""


@pytest.mark.parametrize("cid, how, needles", HF, ids=[c[0] for c in HF])
def test_hf_checkpoint(world, cid, how, needles):
    code = 2 if cid == "hf-path-is-file" or cid in REFUSED_CONFIGS else 1
    run_case(world, f"convert --hf {{T}}/hf/{cid} --out {{T}}/o-{cid}", code, needles, None, new=f"{{T}}/o-{cid}")


@pytest.mark.parametrize("cid, files, opts, code, needles", CKPT, ids=[c[0] for c in CKPT])
def test_torch_dist_checkpoint(world, cid, files, opts, code, needles):
    out = f"{{T}}/o-{cid}"
    if opts.startswith("OUT="):
        out, opts = opts[4:], ""
    run_case(world, f"export --checkpoint {{T}}/ck/{cid} --out {out} {opts}", code, needles, None,
             new=None if out == "{T}/c" else out)


@pytest.mark.parametrize("cid, argv, code, needles", CONVERT_ARGS, ids=[c[0] for c in CONVERT_ARGS])
def test_convert_options(world, cid, argv, code, needles):
    run_case(world, argv, code, needles, None, new="{T}/o-cv")


@pytest.mark.parametrize("cid, run, argv, code, needles", RUNDIR, ids=[c[0] for c in RUNDIR])
def test_run_directory(world, cid, run, argv, code, needles):
    path = str(world["runs"].get(run) or run)
    argv = argv.replace("{R}", path)
    needles = [n.replace("{R}", path) for n in needles]
    run_case(world, argv, code, needles, path if path in world["runs"].values() or path == "{RUN}" else None)


def test_the_corpus_is_large_enough():
    assert len(CONFIG) + len(SET) + len(DATASET) + len(HF) + len(CKPT) + len(CONVERT_ARGS) + len(RUNDIR) >= 150


def test_yaml_anchors_and_merge_keys_still_load(tmp_path):
    """The duplicate-key check leaves YAML's merge keys alone (an explicit key overrides a merged one)."""
    from slimectl.contract.config import load_yaml_file

    p = tmp_path / "anchors.yaml"
    p.write_text("base: &b {lr: 0.1, seed: 3}\ntrain:\n  <<: *b\n  lr: 0.2\n")
    assert load_yaml_file(p)["train"] == {"lr": 0.2, "seed": 3}
