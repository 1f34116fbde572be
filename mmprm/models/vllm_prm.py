"""A PRM served by vLLM: the step scores of `PRMScorer`, computed by vLLM's pooling runner.

vLLM runs the PRM as a token-classification model (`runner="pooling"`, `convert="classify"`,
pooling task `token_classify`): its own implementation of the backbone, images included, and a
one-logit classifier read at every token. Both of mmprm's heads are that classifier:
- token_pair: vLLM builds it from the LM head rows of the two reward tokens
  (`method="from_2_way_softmax"`), logit = (w_pos - w_neg) . h, whose sigmoid is the pair's softmax;
- value: the linear head's weight is written as the classifier's (its bias the scorer adds).
The scorer asks for raw logits and applies the sigmoid itself, at the step tokens that
`mmprm.steps.tokenize_steps` placed: the same token ids and the same step positions as training and
the HF scorer, images expanded by our processor and given to vLLM beside them.

`export_for_vllm(prm_dir, out_dir)` writes the directory vLLM loads (config with the classifier,
weights linked, not copied); it is also what `vllm serve` takes:

    mmprm export-vllm runs/prm runs/prm-vllm
    vllm serve runs/prm-vllm --runner pooling --convert classify --pooler-config '{"task": "token_classify"}'

Released PRMs (`convention=`, docs/released-prms.md): a token-pair one (Math-Shepherd, RLHFlow)
is exported the same way; Qwen2.5-Math-PRM is an architecture vLLM runs itself
(`Qwen2ForProcessRewardModel`), so its directory is served as it is and the scorer reads the two
logits of every step tag.

Tested where vllm is installed (`pytest -m vllm`): scores equal the HF scorer's.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmprm.data.schema import load_image
from mmprm.models.spec import (
    INDEX_FILE,
    VALUE_HEAD_FILE,
    PRMSpec,
    example_field,
    example_steps,
    group_by_prompt,
    progress_bar,
    read_spec,
    released_spec,
    tokenize_example,
    tokenize_named_group,
    weight_files,
)
from mmprm.steps import TokenizedSteps

SCORE_WEIGHTS_FILE = "mmprm_score.safetensors"
# vLLM's engine arguments that make it a token classifier over an exported PRM directory.
POOLING_ARGS = {"runner": "pooling", "convert": "classify", "pooler_config": {"task": "token_classify"}}
# A released classifier PRM (Qwen2.5-Math-PRM) is a pooling model of vLLM's own: every token's two
# logits, not only its step tag's.
CLASSIFIER_POOLING_ARGS = {"runner": "pooling", "pooler_config": {"task": "token_classify", "tok_pooling_type": "ALL"}}


def classifier_config(prm_dir: str | Path, tokenizer: Any | None = None, spec: PRMSpec | None = None) -> dict[str, Any]:
    """The config.json keys that make vLLM read `prm_dir`'s head as a one-logit token classifier
    (`spec`: the PRM's, read from `prm_dir` when not given)."""
    prm_dir = Path(prm_dir)
    spec = spec or read_spec(prm_dir)
    if spec.head == "value":
        return {"id2label": {"0": "step_correct"}, "label2id": {"step_correct": 0}}
    from mmprm.models.loading import load_processor
    from mmprm.models.spec import reward_token_ids

    if tokenizer is None:
        processor = load_processor(str(prm_dir))
        tokenizer = getattr(processor, "tokenizer", processor)
    positive, negative = tokenizer.convert_ids_to_tokens(reward_token_ids(tokenizer, spec.reward_tokens))
    # vLLM's 2-way softmax takes [false, true] and scores the second
    return {"classifier_from_token": [negative, positive], "method": "from_2_way_softmax"}


def export_for_vllm(prm_dir: str | Path, out_dir: str | Path, link: bool = True, spec: PRMSpec | None = None) -> Path:
    """Write `out_dir`: `prm_dir` as vLLM loads it for token classification (`spec`: a released
    token-pair PRM's, `released_spec`; read from `prm_dir` when not given).

    Every file of `prm_dir` is linked (`link=True`; copied otherwise) except config.json, which
    gains the classifier (`classifier_config`); a value head's weight is written as the
    classifier's, in a file that the checkpoint's index (written when there was none) names
    beside every backbone weight. The directory stays a PRM directory: `load_prm` reads it too.
    """
    prm_dir, out = Path(prm_dir).resolve(), Path(out_dir)
    spec = spec or read_spec(prm_dir)
    if spec.head == "classifier":
        raise ValueError(f"{prm_dir}: a classifier PRM ({spec.convention}) is served by vLLM as it is: no export")
    if out.resolve() == prm_dir:
        raise ValueError(f"{out}: export to a directory of its own, not over the PRM")
    out.mkdir(parents=True, exist_ok=True)
    rewritten = {"config.json", INDEX_FILE} if spec.head == "value" else {"config.json"}
    for src in prm_dir.iterdir():
        if src.name in rewritten or src.is_dir():
            continue
        dst = out / src.name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if link:
            dst.symlink_to(src)
        else:
            shutil.copyfile(src, dst)
    config = json.loads((prm_dir / "config.json").read_text())
    classifier = classifier_config(prm_dir, spec=spec)
    config.update(classifier)
    text = config.get("text_config")
    if isinstance(text, dict):
        # vLLM reads a VLM's labels from either config (InternVL: the text one)
        text.update(classifier)
        # vLLM's 2-way-softmax loader reads the tie from the text config, which transformers 5
        # leaves out or contradicts for VLMs (InternVL: tied on the top config, untied on the
        # text one); the checkpoint itself says which: a tied LM head is not saved.
        text["tie_word_embeddings"] = not _saves_lm_head(prm_dir)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if spec.head == "value":
        _export_value_head(prm_dir, out, config)
    return out


def _saves_lm_head(prm_dir: Path) -> bool:
    return any(name.endswith("lm_head.weight") for name in weight_files(prm_dir))


def _export_value_head(prm_dir: Path, out: Path, config: dict[str, Any]) -> None:
    """The value head's weight as the classifier's, in a file of its own that the checkpoint's
    index names (vLLM then loads only the indexed files, not mmprm's `value_head.safetensors`).

    The bias stays out: vLLM adds a classifier bias on text models only, so the scorer adds it
    to the logits itself, the same on every architecture. A VLM keeps its classifier on the
    language model, named as vLLM's weight mapping leaves it.
    """
    from safetensors.torch import load_file, save_file

    name = "language_model.score.weight" if "text_config" in config else "score.weight"
    head = load_file(str(prm_dir / VALUE_HEAD_FILE))
    save_file({name: head["weight"].float().contiguous()}, str(out / SCORE_WEIGHTS_FILE))
    index = prm_dir / INDEX_FILE
    data = json.loads(index.read_text()) if index.exists() else {"metadata": {}, "weight_map": weight_files(prm_dir)}
    data["weight_map"][name] = SCORE_WEIGHTS_FILE
    (out / INDEX_FILE).write_text(json.dumps(data, indent=2) + "\n")


class ImagePlaceholders:
    """How the processor expands an image's placeholder token, so that it can be undone.

    vLLM expands the placeholders of a token prompt itself (Qwen2-VL: one `<|image_pad|>` becomes
    the image's N pads; InternVL: one `<IMG_CONTEXT>` becomes `<img>` + N of them + `</img>`), so
    the ids that `tokenize_steps` expanded go to vLLM with each image's span folded back to its
    one placeholder. The expansion is learned from the processor on a blank image: the same rule
    for every family, no table of them.
    """

    def __init__(self, processor: Any):
        from PIL import Image

        tokenizer = getattr(processor, "tokenizer", processor)
        text = processor.image_token
        (self.placeholder,) = tokenizer(text, add_special_tokens=False)["input_ids"]
        expanded = list(
            processor(text=[text], images=[Image.new("RGB", (56, 56))], add_special_tokens=False)["input_ids"][0]
        )
        self.repeated = max(set(expanded), key=expanded.count)
        first = expanded.index(self.repeated)
        last = len(expanded) - expanded[::-1].index(self.repeated)
        self.before, self.after = expanded[:first], expanded[last:]

    def fold(self, ids: list[int]) -> tuple[list[int], int]:
        """`ids` with every expanded image span folded to its placeholder, and the spans found."""
        out: list[int] = []
        spans, i, n, b = 0, 0, len(ids), len(self.before)
        while i < n:
            if ids[i : i + b] == self.before and i + b < n and ids[i + b] == self.repeated:
                j = i + b
                while j < n and ids[j] == self.repeated:
                    j += 1
                if ids[j : j + len(self.after)] == self.after:
                    out.append(self.placeholder)
                    spans += 1
                    i = j + len(self.after)
                    continue
            out.append(ids[i])
            i += 1
        return out, spans


class VLLMPRMScorer:
    """`PRMScorer`'s interface (`tokenize`, `score`) over a vLLM engine.

    Args:
        prm_path: a PRM directory written by mmprm (`save_prm`, `recipes/prm_train.py`).
        batch_size: examples sent to the engine per `encode` call is 64 x this (vLLM batches them
            itself); inputs are built one call at a time, so memory does not grow with the dataset.
        max_length: longest tokenized example; steps past it are cut and scored NaN, as the HF
            scorer does. Defaults to the engine's max_model_len.
        export_dir: where the vLLM view of the PRM goes (`export_for_vllm`); a temporary directory,
            removed by `close`, when None.
        server_url: score with a running `vllm serve` of this PRM's export instead of an engine of
            our own (e.g. http://gpu-node:8000); the PRM directory still gives the tokenizer, the
            spec and the value head's bias. Text only: vLLM's pooling endpoint takes token ids
            without images.
        convention: a released PRM (`mmprm.models.spec.RELEASED_CONVENTIONS`): a token-pair one is
            exported as mmprm's are; a classifier one (Qwen2.5-Math-PRM) runs as vLLM's own pooling
            model of that architecture, each step's two logits read at its tag.
        **llm_kwargs: passed to `vllm.LLM` (dtype, gpu_memory_utilization, max_model_len,
            tensor_parallel_size, enforce_eager, ...).
    """

    def __init__(
        self,
        prm_path: str | Path,
        batch_size: int = 8,
        max_length: int | None = None,
        export_dir: str | Path | None = None,
        server_url: str | None = None,
        convention: str | None = None,
        **llm_kwargs: Any,
    ):
        from mmprm.models.loading import load_processor

        prm_path = Path(prm_path)
        self.spec = released_spec(convention) if convention and convention != "mmprm" else read_spec(prm_path)
        self.processor = load_processor(str(prm_path))
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.batch_size = batch_size
        self.dropped_steps = 0
        self._tmp = None
        self._server = PoolingServer(server_url) if server_url else None
        limit = {"image": 4, **(llm_kwargs.pop("limit_mm_per_prompt", None) or {})}
        if self.tokenizer is self.processor or self._server is not None:
            limit = {}  # a text model takes no images; nor does the served endpoint
        if self._server is not None:
            if llm_kwargs or export_dir is not None:
                raise ValueError(
                    f"server_url: {server_url} serves the PRM; engine settings ({', '.join(sorted(llm_kwargs))}"
                    f"{', export_dir' if export_dir is not None else ''}) are the server's own: set them on vllm serve"
                )
            self.max_model_len: int = self._server.max_model_len
        else:
            try:
                import vllm
            except ImportError:
                raise ImportError(
                    "the vllm scorer needs vllm: pip install 'mmprm[vllm]' (or use scorer.backend=hf)"
                ) from None
            from mmprm.generation.vllm import check_vllm_version, independent_engine

            check_vllm_version(vllm.__version__)
            self._vllm = vllm
            if self.spec.head == "classifier":
                self.export_dir, engine_args = prm_path, CLASSIFIER_POOLING_ARGS
            else:
                self._tmp = None if export_dir is not None else tempfile.mkdtemp(prefix="mmprm-vllm-prm-")
                self.export_dir = export_for_vllm(prm_path, export_dir or self._tmp, spec=self.spec)
                engine_args = POOLING_ARGS
            with independent_engine():
                self.llm = vllm.LLM(
                    model=str(self.export_dir), limit_mm_per_prompt=limit or None, **{**engine_args, **llm_kwargs}
                )
            self.max_model_len = self.llm.model_config.max_model_len
        if max_length is not None and max_length > self.max_model_len:
            raise ValueError(
                f"max_length={max_length} is over the vLLM engine's max_model_len {self.max_model_len}: "
                "raise max_model_len or lower max_length"
            )
        self.max_length = max_length or self.max_model_len
        self.max_images: int = limit.get("image", 0)
        self._placeholders = ImagePlaceholders(self.processor) if self.max_images else None
        self._bias = 0.0
        if self.spec.head == "value":
            from safetensors.torch import load_file

            self._bias = float(load_file(str(prm_path / VALUE_HEAD_FILE))["bias"].reshape(-1)[0])

    def close(self) -> None:
        """Stop the engine and remove its temporary export; scoring afterwards is an error."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(llm, "shutdown", None) or llm.llm_engine.engine_core.shutdown
            shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def tokenize(self, ex: Any, images: list[Any] | None = None) -> TokenizedSteps:
        """`ex` tokenized as `PRMScorer.tokenize` does; `images`: its images, already loaded."""
        if images is None:
            images = [load_image(p) for p in (example_field(ex, "images") or [])]
        if images and self._server is not None:
            raise ValueError(
                f"id={example_field(ex, 'id', '?')}: has images, and a served PRM scores text only here (vLLM's "
                "pooling endpoint takes token ids without images): score it with an engine of mmprm's "
                "own (backend=vllm without server_url), or without its images"
            )
        if len(images) > self.max_images:
            raise ValueError(
                f"id={example_field(ex, 'id', '?')}: {len(images)} images, over the vLLM scorer's limit of "
                f"{self.max_images} per example: raise it with vllm_kwargs: {{limit_mm_per_prompt: {{image: N}}}}"
            )
        return tokenize_example(self.processor, self.spec, ex, images, self.max_length)

    def score(self, examples: Sequence[Any], share_prefix: bool = True, progress: bool = False) -> list[list[float]]:
        """One probability per step per example (steps cut by max_length get NaN), as `PRMScorer`.

        Candidates of one question and images are tokenized once for the prompt (`extend_steps`;
        `share_prefix=False`: each alone). The engine runs every candidate whole: vLLM does not
        read its prefix cache for token-level pooling, whose output is every token's logit.
        """
        results: list[list[float] | None] = [None] * len(examples)
        per_call = 64 * self.batch_size
        groups, empty = group_by_prompt(examples, share_prefix)
        for i in empty:
            results[i] = []  # nothing to score; aggregators rank an empty candidate last
        bar = progress_bar(sum(map(len, groups)), progress)
        pending: list[tuple[int, TokenizedSteps, list[Any]]] = []
        for idx in groups:
            images = [load_image(p) for p in (example_field(examples[idx[0]], "images") or [])]
            alone = functools.partial(self.tokenize, images=images)
            toks = tokenize_named_group(self.processor, self.spec, examples, idx, self.max_length, alone)
            pending.extend((i, tok, images) for i, tok in zip(idx, toks))
            if len(pending) >= per_call:
                self._encode(pending, examples, results, bar)
                pending = []
        self._encode(pending, examples, results, bar)
        bar.close()
        return results  # type: ignore[return-value]

    def _encode(
        self,
        pending: list[tuple[int, TokenizedSteps, list[Any]]],
        examples: Sequence[Any],
        results: list[list[float] | None],
        bar: Any,
    ) -> None:
        if not pending:
            return
        import torch

        prompts = []
        for i, tok, images in pending:
            prompt: dict[str, Any] = {"prompt_token_ids": tok.input_ids}
            if images:
                assert self._placeholders is not None  # tokenize refused images over the limit of 0
                ids, spans = self._placeholders.fold(tok.input_ids)
                if spans != len(images):
                    raise ValueError(
                        f"id={example_field(examples[i], 'id', '?')}: {len(images)} image(s) but {spans} image "
                        "placeholder span(s) in its tokens: a question or step that writes the image "
                        "token itself cannot be scored"
                    )
                prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
            prompts.append(prompt)
        for (i, tok, _), (ids, data) in zip(pending, self._token_logits(prompts)):
            if ids != tok.input_ids:
                raise ValueError(
                    f"id={example_field(examples[i], 'id', '?')}: vLLM expanded its images to "
                    f"{len(ids)} tokens where mmprm's processor gives {len(tok.input_ids)}: "
                    "give the engine the processor's image settings (vllm_kwargs: {mm_processor_kwargs: "
                    "{min_pixels: N, max_pixels: N}})"
                )
            logits = data.reshape(len(tok.input_ids), -1)[tok.step_positions].float()  # (steps, 1 or 2)
            if self.spec.head == "classifier":
                probs = torch.softmax(logits, dim=-1)[:, self.spec.positive_label].tolist()
            else:
                probs = torch.sigmoid(logits[:, 0] + self._bias).tolist()
            results[i] = probs + [float("nan")] * (len(example_steps(examples[i])) - len(probs))
            self.dropped_steps += tok.dropped_steps
        bar.update(len(pending))

    def _token_logits(self, prompts: list[dict[str, Any]]) -> list[tuple[list[int], Any]]:
        """(the prompt's token ids as the engine expanded them, one logit per token) per prompt."""
        if self._server is not None:
            return self._server.token_logits([p["prompt_token_ids"] for p in prompts])
        params = self._vllm.PoolingParams(use_activation=False)
        outputs = self.llm.encode(prompts, params, pooling_task="token_classify", use_tqdm=False)
        return [(list(out.prompt_token_ids), out.outputs.data) for out in outputs]


class PoolingServer:
    """A client of `vllm serve`'s pooling endpoint for a PRM export (`export_for_vllm`)."""

    def __init__(self, url: str, timeout: float = 600.0, attempts: int = 3):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout, self.attempts = timeout, attempts
        models = self._call("GET", "/v1/models")["data"]
        if not models:
            raise ValueError(f"server_url: {self.url} serves no model")
        self.model: str = models[0]["id"]
        self.max_model_len: int = int(models[0].get("max_model_len") or 0) or 1 << 30

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        import time
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        for attempt in range(self.attempts):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:  # the server's answer: a bad request is not retried
                raise ValueError(f"server_url: {self.url}{route} answered {e.code}: {e.read()[:500]!r}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.attempts - 1:
                    raise ConnectionError(
                        f"server_url: {self.url}{route} did not answer after {self.attempts} tries ({e}); is "
                        "`vllm serve` running there with --runner pooling (docs/serving.md)?"
                    ) from None
                time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def token_logits(self, prompts: list[list[int]]) -> list[tuple[list[int], Any]]:
        import torch

        body = {
            "model": self.model,
            "input": prompts,
            "task": "token_classify",
            "use_activation": False,
            "add_special_tokens": False,
        }
        rows = sorted(self._call("POST", "/pooling", body)["data"], key=lambda r: r["index"])
        return [(ids, torch.tensor(row["data"], dtype=torch.float32)) for ids, row in zip(prompts, rows)]


def cli_export_vllm(argv: list[str]) -> int:
    """`mmprm export-vllm PRM_DIR OUT_DIR [--copy]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="mmprm export-vllm",
        description="Write a PRM directory as vLLM serves it (token classification); see mmprm.models.vllm_prm.",
    )
    parser.add_argument("prm_dir", help="a PRM directory written by mmprm (recipes/prm_train.py)")
    parser.add_argument("out_dir", help="where to write the vLLM view of it")
    parser.add_argument("--copy", action="store_true", help="copy the weights instead of linking them")
    parser.add_argument(
        "--convention",
        help="a released token-pair PRM's convention (math_shepherd, rlhflow, mm_prm, visualprm); docs/released-prms.md",
    )
    args = parser.parse_args(argv)
    try:
        spec = released_spec(args.convention) if args.convention else None
        out = export_for_vllm(args.prm_dir, args.out_dir, link=not args.copy, spec=spec)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"mmprm export-vllm: {e}\n")
    served = {"task": "token_classify"}
    print(
        f"{out}\nserve it: vllm serve {out} --runner pooling --convert classify --pooler-config '{json.dumps(served)}'"
    )
    return 0
