"""`miles serve`: the rollout engine behind HTTP, with an SGLang-compatible subset.

Endpoints: POST /generate, GET /health, POST /flush_cache, GET /get_model_info,
GET /get_server_info, POST /update_weights_from_disk, POST /get_weights_by_name,
POST /init_weights_update_group, POST /update_weights_from_distributed (what
`--rollout-backend sglang` uses, so the whole SGLang path runs against `miles serve` on CPU), and
the OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (for agents
written against the `openai` client; responses carry the token ids). One engine thread runs continuous batching over every request
in flight, so concurrent HTTP clients (agentic, multi-turn rollouts) share batches. A malformed
request gets a 4xx with a JSON {"error": ...}; it never reaches the engine.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from concurrent.futures import Future
from typing import Any

import torch

from miles.data.sample import Sample
from miles.errors import MilesError
from miles.rollout.engine import Engine
from miles.rollout.http import BadRequest, Listener, json_handler
from miles.rollout.sampling import Request, SamplingParams

SAMPLING_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_new_tokens": int,
    "stop": (str, list),
    "stop_token_ids": list,
    "ignore_eos": bool,
    "seed": int,
    "sampling_seed": int,  # SGLang's name for seed
}
# Accepted for SGLang compatibility; they do not change what miles returns.
SAMPLING_NO_OPS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
TOP_LEVEL_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_routed_experts",
    "rid",
    "stream",
    "image_data",
}


def parse_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object")
    kwargs = {}
    for key, value in raw.items():
        if key in SAMPLING_NO_OPS:
            continue
        if key not in SAMPLING_KEYS:
            raise BadRequest(f"sampling_params.{key} is not supported; supported: {sorted(SAMPLING_KEYS)}")
        kind = SAMPLING_KEYS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadRequest(f"sampling_params.{key} has the wrong type: {value!r}")
        if kind is float and not math.isfinite(value):
            raise BadRequest(f"sampling_params.{key} must be a finite number, got {value!r}")
        kwargs["seed" if key == "sampling_seed" else key] = value
    try:
        return SamplingParams(**kwargs)
    except MilesError as e:
        raise BadRequest(f"sampling_params: {e}") from e


def longest_token(tokenizer) -> int:
    """Characters in the tokenizer's longest token: a text longer than that times the context
    cannot fit, whatever it says, so it is refused without tokenizing it."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def parse_prompts(body: dict, tokenizer, max_chars: int | None = None) -> tuple[list[list[int]], bool]:
    """(token id lists, whether the request was a batch); `max_chars`: a text longer than this is
    refused before tokenizing (it cannot fit the context)."""
    has_text, has_ids = "text" in body, "input_ids" in body
    if has_text == has_ids:
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if has_text:
        text = body["text"]
        if tokenizer is None:
            raise BadRequest("this server has no tokenizer; send input_ids")
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("'text' must be a non-empty string or a list of them")
        if max_chars is not None and (longest := max(len(t) for t in texts)) > max_chars:
            raise BadRequest(
                f"'text' of {longest} characters cannot fit the model's context; send a shorter prompt"
            )
        return [tokenizer(t).input_ids for t in texts], batch
    ids = body["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    seqs = ids if batch else [ids]
    for seq in seqs:
        if (
            not isinstance(seq, list)
            or not seq
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq)
        ):
            raise BadRequest("'input_ids' must be a non-empty list of token ids (or a list of such lists)")
    return seqs, batch


def sample_response(sample: Sample, engine: Engine, logprob: bool, routed: bool) -> dict:
    meta: dict[str, Any] = {
        "id": str(sample.metadata["request_id"]),
        "finish_reason": sample.metadata["finish_reason"],
        "prompt_tokens": sample.prompt_length,
        "completion_tokens": sample.response_length,
        "weight_version": sample.weight_versions[-1] if sample.weight_versions else engine.weight_version,
        "weight_versions": sample.weight_versions,
    }
    if logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(sample.rollout_log_probs, sample.response_tokens)
        ]
    if routed:
        meta["routed_experts"] = (
            None if sample.rollout_routed_experts is None else sample.rollout_routed_experts.tolist()
        )
    return {"text": sample.response, "output_ids": sample.response_tokens, "meta_info": meta}


class EngineServer:
    """Runs `engine` on its own thread and serves it over HTTP."""

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 30000, model_path: str = ""
    ) -> None:
        self.engine, self.model_path = engine, model_path
        self.default_max_tokens = 128  # an OpenAI request without max_tokens
        self.weight_groups: dict[str, Any] = {}  # SGLang-style weight-update groups joined, by name
        self._inbox: queue.Queue[tuple[Request, Future]] = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._stop = threading.Event()
        self._longest_token: int | None = None
        self.httpd = Listener((host, port), self._handler_class())
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._threads = [
            threading.Thread(target=self._engine_loop, daemon=True, name="miles-engine"),
            threading.Thread(target=self.httpd.serve_forever, daemon=True, name="miles-http"),
        ]

    def _max_chars(self) -> int | None:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return None
        if self._longest_token is None:
            self._longest_token = longest_token(tokenizer)
        return self.engine.max_seq_len * self._longest_token

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EngineServer:
        for t in self._threads:
            t.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=10)

    def submit(self, request: Request) -> Future:
        fut: Future = Future()
        self._inbox.put((request, fut))
        return fut

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = 0 if self.engine.has_work() else 0.05
                while True:
                    request, fut = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
                    timeout = 0
                    try:
                        self._futures[self.engine.add_request(request)] = fut
                    except MilesError as e:
                        fut.set_exception(e)
            except queue.Empty:
                pass
            if self.engine.has_work():
                for sample in self.engine.step():
                    fut = self._futures.pop(sample.metadata["request_id"], None)
                    if fut is not None:
                        fut.set_result(sample)

    def _handler_class(self):
        return json_handler(self.get, self.post)

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, {"status": "ok"}
        if path == "/get_model_info":
            cfg = self.engine.model.config
            return 200, {
                "model_path": self.model_path,
                "is_generation": True,
                "model_type": cfg.model_type,
                "weight_version": self.engine.weight_version,
            }
        if path == "/get_server_info":
            return 200, self.server_info()
        if path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "miles"}],
            }
        return 404, {"error": f"no such endpoint: GET {path}"}

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/generate":
            return 200, self.generate(body)
        if path == "/flush_cache":
            ok = self.engine.flush_cache()
            message = "Cache flushed." if ok else "requests in flight; cache not flushed"
            return (200 if ok else 400), {"success": ok, "message": message}
        routes = {
            "/update_weights_from_disk": self.update_from_disk,
            "/get_weights_by_name": self.weights_by_name,
            "/init_weights_update_group": self.init_weights_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/v1/chat/completions": self.chat_completions,
            "/v1/completions": self.completions,
        }
        if path not in routes:
            return 404, {"error": f"no such endpoint: POST {path}"}
        return 200, routes[path](body)

    @property
    def model_name(self) -> str:
        return self.model_path or "miles"

    def _generate_one(self, ids: list[int], params: SamplingParams) -> Sample:
        if len(ids) >= self.engine.max_seq_len:
            raise BadRequest(
                f"prompt of {len(ids)} tokens does not fit the context of {self.engine.max_seq_len}"
            )
        return self.submit(Request(ids, params)).result()

    def chat_completions(self, body: Any) -> dict:
        """OpenAI /v1/chat/completions (no streaming, n=1), with the token ids it used."""
        from miles.agents import openai_api as api
        from miles.agents.chat import encode, render

        try:
            messages, tools = api.chat_request(body)
            params = api.sampling(body, self.default_max_tokens)
        except api.APIError as e:
            raise BadRequest(str(e)) from e
        tokenizer = self.engine.tokenizer
        ids = encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=True))
        sample = self._generate_one(ids, params)
        return api.chat_response(
            sample, tokenizer, body.get("model") or self.model_name, bool(body.get("logprobs"))
        )

    def completions(self, body: Any) -> dict:
        """OpenAI /v1/completions (one prompt: text or token ids), with the token ids it used."""
        from miles.agents import openai_api as api

        try:
            ids = api.completion_request(body, self.engine.tokenizer)
            params = api.sampling(body, self.default_max_tokens)
        except api.APIError as e:
            raise BadRequest(str(e)) from e
        sample = self._generate_one(ids, params)
        return api.completion_response(
            sample, self.engine.tokenizer, body.get("model") or self.model_name, bool(body.get("logprobs"))
        )

    def generate(self, body: Any) -> Any:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        unknown = set(body) - TOP_LEVEL_KEYS
        if unknown:
            raise BadRequest(f"unsupported field(s) {sorted(unknown)}; supported: {sorted(TOP_LEVEL_KEYS)}")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by miles serve yet")
        raw = body.get("sampling_params")
        if isinstance(raw, dict) and raw.get("max_new_tokens") == 0:
            return self.score(body, raw)
        params = parse_sampling(body.get("sampling_params"))
        prompts, batch = parse_prompts(body, self.engine.tokenizer, self._max_chars())
        self._check_inputs(prompts, "prompt", self.engine.max_seq_len - 1)  # room for a token
        if params.stop and self.engine.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer; use stop_token_ids")
        images = self._images(body, prompts)
        futures = [
            self.submit(Request(list(p), SamplingParams(**vars(params)), images=images)) for p in prompts
        ]
        samples = [f.result() for f in futures]
        out = [
            sample_response(
                s, self.engine, bool(body.get("return_logprob")), bool(body.get("return_routed_experts"))
            )
            for s in samples
        ]
        return out if batch else out[0]

    @functools.cached_property
    def _vision_processor(self):
        from miles.data.images import VisionProcessor

        config = self.engine.model.config
        return VisionProcessor(self.engine.tokenizer, config.vision_config.spatial_merge_size)

    def _images(self, body: dict, prompts: list) -> dict | None:
        """The pixels of a prompt's image_data (SGLang's field: its images, base64 PNG or paths),
        made by this model's processor; the ids already hold their expanded image tokens."""
        if "image_data" not in body:
            return None
        config = self.engine.model.config
        if not config.is_vision_language:
            raise BadRequest("image_data: this server's model is not a vision-language model")
        data = body["image_data"]
        if len(prompts) != 1 or not isinstance(data, list) or not data:
            raise BadRequest("image_data: a non-empty list of images, for one prompt (not a batch)")
        try:
            return self._vision_processor.pixels(data)
        except MilesError as e:
            raise BadRequest(str(e)) from e

    def _check_inputs(self, prompts, what: str, longest: int) -> None:
        """Each token sequence at most `longest` tokens long, of ids in the vocabulary."""
        vocab = self.engine.model.config.vocab_size
        for p in prompts:
            if len(p) > longest:
                raise BadRequest(
                    f"{what} of {len(p)} tokens does not fit the context of {self.engine.max_seq_len}"
                )
            if max(p) >= vocab or min(p) < 0:
                raise BadRequest(f"input_ids must be in [0, {vocab})")

    def score(self, body: dict, raw_params: dict) -> Any:
        """SGLang's prefill-only request (max_new_tokens 0, return_logprob): meta_info.input_token_logprobs
        from `logprob_start_len` on, [log-prob, token id, None] per token (None for the first token,
        which has no context), at the request's temperature (0 or none: the raw logits)."""
        if not body.get("return_logprob"):
            raise BadRequest("max_new_tokens 0 generates nothing; add return_logprob to score the input")
        temperature = raw_params.get("temperature") or 1.0
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise BadRequest(f"sampling_params.temperature must be a finite number >= 0, got {temperature!r}")
        start = body.get("logprob_start_len", 0)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise BadRequest(f"logprob_start_len must be an integer >= 0, got {start!r}")
        topk = body.get("top_logprobs_num") or 0
        vocab = self.engine.model.config.vocab_size
        if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= vocab:
            raise BadRequest(f"top_logprobs_num must be an integer in [0, {vocab}], got {topk!r}")
        prompts, batch = parse_prompts(body, self.engine.tokenizer, self._max_chars())
        self._check_inputs(prompts, "input", self.engine.max_seq_len)
        scored = self.engine.score([list(p) for p in prompts], float(temperature), topk)
        out = []
        for ids, one in zip(prompts, scored):
            values = [None, *one.logprobs.tolist()]
            kept = range(min(start, len(ids)), len(ids))
            meta = {
                "id": None, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "completion_tokens": 0, "weight_version": self.engine.weight_version,
                "input_token_logprobs": [[values[i], ids[i], None] for i in kept],
                "output_token_logprobs": [],
            }  # fmt: skip
            if topk:  # SGLang's layout: per position [[log-prob, token id, text], ...], likeliest first
                top = [None, *([[v, t, None] for v, t in zip(vs, ts)] for vs, ts in
                                zip(one.top_logprobs.tolist(), one.top_ids.tolist()))]  # fmt: skip
                meta["input_top_logprobs"] = [top[i] for i in kept]
            out.append({"text": "", "output_ids": [], "meta_info": meta})
        return out if batch else out[0]

    def server_info(self) -> dict:
        from miles import __version__

        return {
            "version": f"miles-serve {__version__}",
            "model_path": self.model_path,
            "weight_version": self.engine.weight_version,
            "max_total_num_tokens": min(
                self.engine.kv_budget.tokens, self.engine.max_seq_len * self.engine.slots
            ),
            "tp_size": 1,
        }

    def weights_by_name(self, body: Any) -> list:
        """SGLang's /get_weights_by_name: a parameter's first `truncate_size` values, flattened."""
        from miles.lora.serving import served_adapter
        from miles.models.checkpoint import hf_state_dict

        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise BadRequest("get_weights_by_name needs {'name': '<parameter>', 'truncate_size': N}")
        size = body.get("truncate_size", 100)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise BadRequest("truncate_size must be a positive integer")
        state = {**hf_state_dict(self.engine.model), **served_adapter(self.engine.model).served}  # LoRA too
        if body["name"] not in state:
            raise BadRequest(f"no parameter {body['name']!r}; e.g. {sorted(state)[:3]}")
        return state[body["name"]].detach().float().reshape(-1)[:size].tolist()

    def init_weights_group(self, body: Any) -> dict:
        """SGLang's /init_weights_update_group: join the trainer's group as rank `rank_offset`
        (blocks until every member has joined)."""
        from miles.sync.sglang_group import GROUP_NAME, init_custom_process_group

        need = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int}
        if not isinstance(body, dict) or any(not isinstance(body.get(k), t) for k, t in need.items()):
            raise BadRequest(
                f"init_weights_update_group needs {sorted(need)} ({', '.join(t.__name__ for t in need.values())})"
            )
        backend = body.get("backend", "gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # a CPU server joins over gloo
        name = body.get("group_name", GROUP_NAME)
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        self.weight_groups[name] = init_custom_process_group(
            backend, init, body["world_size"], body["rank_offset"], name
        )
        return {
            "success": True,
            "message": f"joined {name} as rank {body['rank_offset']} of {body['world_size']}",
        }

    def update_from_distributed(self, body: Any) -> dict:
        """SGLang's /update_weights_from_distributed: receive each named tensor from rank 0 of
        the group, in order, then swap them in between decoding steps."""
        from miles.sync.sglang_group import GROUP_NAME, receive_tensors

        if not isinstance(body, dict) or not all(
            isinstance(body.get(k), list) for k in ("names", "dtypes", "shapes")
        ):
            raise BadRequest("update_weights_from_distributed needs lists 'names', 'dtypes' and 'shapes'")
        name = body.get("group_name", GROUP_NAME)
        if name not in self.weight_groups:
            raise BadRequest(f"no weight-update group {name!r}: POST /init_weights_update_group first")
        version = body.get("weight_version")
        version = (
            int(version) if isinstance(version, (int, str)) and str(version).lstrip("-").isdigit() else None
        )
        named = receive_tensors(self.weight_groups[name], body["names"], body["dtypes"], body["shapes"])
        bad = [n for n, t in named if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise BadRequest(f"tensor {bad[0]!r} holds NaN or inf; the served weights are unchanged")
        self.engine.update_weights(named, version=version)
        return {
            "success": True,
            "message": f"{len(named)} tensors",
            "weight_version": self.engine.weight_version,
        }

    def update_from_disk(self, body: Any) -> dict:
        from miles.lora.peft_files import is_adapter_dir, sync_payload_of
        from miles.models.checkpoint import hf_state_dict, load_model

        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("update_weights_from_disk needs {'model_path': '<checkpoint dir>'}")
        version = body.get("weight_version")
        if isinstance(version, str) and version.lstrip("-").isdigit():  # SGLang sends it as a string
            version = int(version)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise BadRequest("weight_version must be an integer (or a string of one)")
        if is_adapter_dir(body["model_path"]):  # a LoRA run's sync: its adapter, merged onto the base
            state = dict(sync_payload_of(body["model_path"]))
        else:
            state = hf_state_dict(load_model(body["model_path"]))
        bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise BadRequest(
                f"{body['model_path']}: tensor {bad[0]!r} holds NaN or inf ({len(bad)} such tensor(s)); "
                "the served weights are unchanged"
            )
        self.engine.update_weights(state.items(), version=version)
        return {
            "success": True,
            "message": f"loaded {body['model_path']}",
            "weight_version": self.engine.weight_version,
        }
