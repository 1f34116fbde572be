"""The search on real generation backends: HF generate (default tier) and vLLM vs HF (vllm tier).

A toy policy (a tiny preset taught our step format, `mmprm.annotate.simulated.train_toy_policy`)
decoded greedily (top_k=1) is deterministic, so the tree it grows is known: every expansion of a
node is the same step, and step-by-step search must rebuild exactly the solution one greedy
`generate` writes in one go - which checks that each step continues the assistant message the way
annotation rollouts do.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from mmprm.search.core import SearchConfig, SearchTree, run_search

REPO = Path(__file__).resolve().parents[1]
QUESTION = "The bar shows 2 and then 3 more. What is the total?"


def tree_shape(tree: SearchTree) -> list[tuple]:
    return [(n.parent, n.step, n.answer, n.status, n.kept) for n in tree.nodes]


@pytest.fixture(scope="module")
def toy_policy(tmp_path_factory):
    from mmprm.annotate.simulated import train_toy_policy
    from mmprm.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("search_policy")
    base = build_tiny_model("qwen2", root / "base", seed=0)
    return train_toy_policy(str(base), str(root / "policy"), steps=150)


@pytest.fixture(scope="module")
def prm(toy_policy):
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    torch.manual_seed(0)
    backbone, processor = load_backbone(toy_policy)
    return PRMScorer(build_prm(backbone, processor, PRMSpec()), processor, batch_size=16)


def test_auto_device_is_the_local_ranks_gpu(monkeypatch):
    """resolve_device("auto"): the node-local rank's GPU when several are visible (a rank past
    them is an error), the one GPU when one is (srun or the user narrowed it), the CPU without
    CUDA; anything else as given."""
    import torch

    from mmprm.models.loading import resolve_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert resolve_device("auto") == "cuda:3"
    monkeypatch.setenv("LOCAL_RANK", "5")  # torchrun/accelerate's rank wins over srun's
    assert resolve_device("auto") == "cuda:5"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=5 but only 4 GPUs are visible"):
        resolve_device("auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda:0"


def test_make_rollout_backend_samples_on_this_process_device(tiny_models, monkeypatch):
    """The one builder every recipe uses: HF on the local rank's device (the CPU without CUDA,
    whatever the rank), with the recipe's batch size, system prompt and step format; an unknown
    backend is named."""
    from mmprm.generation import make_rollout_backend
    from mmprm.generation.base import SamplingConfig

    monkeypatch.setenv("LOCAL_RANK", "3")
    sampling = SamplingConfig(max_new_tokens=4, seed=7)
    backend = make_rollout_backend(
        str(tiny_models("qwen2")), sampling, "blank_lines", "Be brief.", batch_size=5, attn_implementation="eager"
    )
    assert next(backend.model.parameters()).device.type == "cpu"
    assert (backend.batch_size, backend.system, backend.step_mode, backend.sampling) == (
        5,
        "Be brief.",
        "blank_lines",
        sampling,
    )
    assert backend.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"backend: 'tgi' is not one of \['hf', 'vllm'\]"):
        make_rollout_backend("unused", sampling, "tags", None, backend="tgi")


def test_make_rollout_backend_vllm_engine_arguments(monkeypatch):
    """The engine arguments all four recipes' keys become: dtype (None: auto), memory share and
    context length when set, then the user's vllm_kwargs, which win. The engine itself runs in the
    vLLM tier (tests/test_vllm_recipes.py); here it is replaced by a recorder."""
    import mmprm.generation.vllm as vllm_backend
    from mmprm.generation import make_rollout_backend
    from mmprm.generation.base import SamplingConfig

    made, pinned = [], []
    monkeypatch.setattr(vllm_backend, "VLLMBackend", lambda path, sampling, **kw: made.append((path, kw)) or kw)
    monkeypatch.setattr(vllm_backend, "pin_local_gpu", lambda tp=1: pinned.append(tp))
    sampling = SamplingConfig(max_new_tokens=4)

    make_rollout_backend("m", sampling, "tags", None, backend="vllm")
    assert made[-1] == ("m", {"step_mode": "tags", "system": None, "dtype": "auto"})
    make_rollout_backend(
        "m",
        sampling,
        "blank_lines",
        "Be brief.",
        backend="vllm",
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        max_model_len=4096,
        vllm_kwargs={"enforce_eager": True, "max_model_len": 2048},
    )
    assert made[-1][1] == {
        "step_mode": "blank_lines",
        "system": "Be brief.",
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "max_model_len": 2048,
        "enforce_eager": True,
    }
    assert pinned == [1, 1]
    make_rollout_backend("m", sampling, "tags", None, backend="vllm", vllm_kwargs={"tensor_parallel_size": 4})
    assert pinned[-1] == 4  # the engine's GPUs are pinned as a block


def test_an_untested_vllm_version_is_refused_unless_the_user_opts_out(monkeypatch):
    """The engine start refuses a vLLM outside the tested range (its request ids may differ), naming
    the version and the range; MMPRM_ALLOW_UNTESTED_VLLM=1 runs it with a warning. The range is
    pyproject's `vllm` extra, so the two cannot drift apart."""
    import tomllib

    from mmprm.generation.vllm import TESTED_VLLM, check_vllm_version

    monkeypatch.delenv("MMPRM_ALLOW_UNTESTED_VLLM", raising=False)
    for ok in ("0.32.0", "0.33.1+cu130", "0.33.0rc1"):
        check_vllm_version(ok)
    for bad in ("0.34.0", "0.31.2", "1.0.0", "not-a-version"):
        with pytest.raises(RuntimeError, match=rf"vllm {bad} is installed, but mmprm is tested on vllm >=0.32,<0.34"):
            check_vllm_version(bad)
    monkeypatch.setenv("MMPRM_ALLOW_UNTESTED_VLLM", "1")
    with pytest.warns(UserWarning, match="vllm 0.34.0 is untested"):
        check_vllm_version("0.34.0")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    (lo, hi) = TESTED_VLLM
    assert extra == [f"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"]


def test_vllm_prompt_length_check_refuses_what_vllm_refuses():
    """vLLM refuses a prompt of max_model_len tokens or more (no room for one generated token), and
    with it the whole call; a question's prompt must leave max_new_tokens, or long solutions are
    cut and graded wrong. Either request alone becomes its problem's input error, saying what to
    change. The count itself runs against a real engine in the vLLM tier (tests/test_vllm_backend.py)."""
    from mmprm.generation.base import RolloutInputError, RolloutRequest
    from mmprm.generation.vllm import check_prompt_length

    req = RolloutRequest("p7", "Q", ["/data/bars.png"], ["Step one.", "Step two."], 4)
    check_prompt_length(3, req, 1023, 1024, 256)  # a continuation: one token of room is enough
    with pytest.raises(RolloutInputError) as err:
        check_prompt_length(3, req, 1024, 1024, 256)
    message = str(err.value)
    assert err.value.index == 3 and message.startswith("problem p7: ")
    assert "1 image(s), 2 step(s) so far) is 1024 tokens" in message and "max_model_len 1024" in message
    for fix in ("policy.vllm.max_model_len", "shorten the question", "max_pixels"):
        assert fix in message
    root = RolloutRequest("p8", "Q", [], [], 4)
    check_prompt_length(0, root, 768, 1024, 256)  # a whole solution of 256 tokens fits
    with pytest.raises(RolloutInputError, match="is 769 tokens, .* leaves fewer than max_new_tokens=256"):
        check_prompt_length(0, root, 769, 1024, 256)


def test_vllm_image_count_check_refuses_what_vllm_refuses():
    """More images than the engine's limit_mm_per_prompt make vLLM refuse the whole call: that
    request alone becomes its problem's input error, saying which key raises the limit."""
    from mmprm.generation.base import RolloutInputError, RolloutRequest
    from mmprm.generation.vllm import check_image_count

    req = RolloutRequest("p7", "Q", [f"/data/{k}.png" for k in range(5)], [], 4)
    check_image_count(0, req, 5)
    with pytest.raises(RolloutInputError) as err:
        check_image_count(2, req, 4)
    assert err.value.index == 2 and str(err.value).startswith("problem p7: 5 images, over")
    assert "limit of 4 per prompt" in str(err.value) and "limit_mm_per_prompt: {image: N}" in str(err.value)


@pytest.mark.slow
def test_hf_greedy_search_rebuilds_the_greedy_solution(toy_policy, prm):
    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.hf import HFBackend
    from mmprm.search.policy import BackendProposer, sample_solutions

    greedy = SamplingConfig(top_k=1, max_new_tokens=96, seed=0)
    backend = HFBackend.from_pretrained(toy_policy, greedy, device="cpu", batch_size=32)
    problems = [{"id": f"p{i}", "question": QUESTION, "images": []} for i in range(2)]
    [one_go] = sample_solutions(backend, problems[:1], n=1)
    assert one_go[0]["complete"], one_go  # the toy policy writes steps and an answer

    backend.sampling.max_new_tokens = 32  # one step at a time
    proposer = BackendProposer(backend)
    cfg = SearchConfig("beam", width=2, expansions=3, max_steps=6)
    trees = run_search(problems, proposer, prm, cfg)
    for tree in trees:
        chosen = tree.nodes[tree.chosen]
        # greedy: the expansions of a node are one step three times; distinct paths keep one per round
        for parent in {n.parent for n in tree.nodes[1:]}:
            kids = [n for n in tree.nodes if n.parent == parent]
            assert len({(k.step, k.answer) for k in kids}) == 1 and sum(k.kept for k in kids) == 1
        assert chosen.status == "finished"
        assert tree.prm_path(chosen) == one_go[0]["steps"] and chosen.answer == one_go[0]["answer"]
        assert tree.stats["generated_tokens"] > 0 and tree.stats["prm_sequences"] == len(tree.nodes) - 1
    assert tree_shape(trees[0]) == tree_shape(trees[1])  # same question, same greedy tree
    again = run_search(problems[:1], BackendProposer(backend), prm, cfg)
    assert tree_shape(again[0]) == tree_shape(trees[0])
    assert [p for n in again[0].nodes for p in n.probs] == pytest.approx([p for n in trees[0].nodes for p in n.probs])


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed: `make test-vllm` runs this tier in .venv-vllm",
)
def test_vllm_and_hf_grow_the_same_greedy_tree(request, tmp_path):
    """Both backends, greedy, the same toy policy and PRM: the same search tree node for node."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.hf import HFBackend
    from mmprm.generation.vllm import VLLMBackend
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm
    from mmprm.search.policy import BackendProposer

    try:  # the vllm tier's toy policies (head_dim 64, which vLLM's CPU kernels need)
        path = str(request.getfixturevalue("vllm_toy_policy")("qwen2"))
    except pytest.FixtureLookupError:
        pytest.skip("needs the vllm tier's `vllm_toy_policy` fixture (tests/conftest.py)")
    backbone, processor = load_backbone(path)
    prm = PRMScorer(build_prm(backbone, processor, PRMSpec()), processor, batch_size=16)
    greedy = SamplingConfig(top_k=1, max_new_tokens=32, seed=0)
    problems = [{"id": "p0", "question": QUESTION, "images": []}]
    cfg = SearchConfig("beam", width=2, expansions=2, max_steps=6)
    hf = HFBackend.from_pretrained(path, greedy, dtype="float32", device="cpu")
    vllm = VLLMBackend(path, greedy, dtype="float32", enforce_eager=True, max_model_len=1024)
    try:
        [t_hf] = run_search(problems, BackendProposer(hf), prm, cfg)
        [t_vllm] = run_search(problems, BackendProposer(vllm), prm, cfg)
    finally:
        vllm.llm.llm_engine.engine_core.shutdown()
    assert tree_shape(t_vllm) == tree_shape(t_hf)
    assert t_hf.nodes[t_hf.chosen].status == "finished"
    assert [n.score for n in t_vllm.nodes] == pytest.approx([n.score for n in t_hf.nodes])


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed: `make test-vllm` runs this tier in .venv-vllm",
)
def test_vllm_engine_starts_with_a_later_shards_seed(request):
    """Shard/rank >= 1 samples from worker_seed(seed, i) >= 2**40; vLLM seeds numpy with the engine
    seed, which takes < 2**32 only - the engine used to die at start on every shard but the first."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from mmprm.generation.base import RolloutRequest, SamplingConfig, worker_seed
    from mmprm.generation.vllm import VLLMBackend

    try:
        path = str(request.getfixturevalue("vllm_toy_policy")("qwen2"))
    except pytest.FixtureLookupError:
        pytest.skip("needs the vllm tier's `vllm_toy_policy` fixture (tests/conftest.py)")
    sampling = SamplingConfig(max_new_tokens=8, seed=worker_seed(0, 1))
    backend = VLLMBackend(path, sampling, dtype="float32", enforce_eager=True, max_model_len=512)
    try:
        [outs] = backend.generate([RolloutRequest("p0", QUESTION, [], [], 2)])
    finally:
        backend.llm.llm_engine.engine_core.shutdown()
    assert len(outs) == 2


def test_image_cache_decodes_once_and_keeps_the_most_recent(tmp_path, monkeypatch):
    """Both backends send a problem's image with each of its rollout calls: decoded once, the
    least recently used dropped past `size`."""
    from PIL import Image

    import mmprm.data.schema as schema
    from mmprm.generation.base import ImageCache

    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.new("RGB", (8, 8), (i, 0, 0)).save(paths[-1])
    opened: list[str] = []
    load = schema.load_image
    monkeypatch.setattr(schema, "load_image", lambda p: opened.append(p) or load(p))
    cache = ImageCache(size=2)
    a = cache(paths[0])
    assert cache(paths[0]) is a and opened == [paths[0]]
    cache(paths[1])
    cache(paths[0])  # 0 is now the most recent: 1 goes first
    cache(paths[2])
    assert cache(paths[0]) is a and opened == paths
    cache(paths[1])
    assert opened == [*paths, paths[1]] and a.getpixel((0, 0)) == (0, 0, 0)


def test_each_rank_pins_its_own_gpu_inside_an_allocation(monkeypatch):
    """Inside a Slurm allocation CUDA_VISIBLE_DEVICES already lists the node's GPUs: each rank must
    take its own entry of that list, not the whole list (every engine would open the first GPU)."""
    from mmprm.generation.vllm import local_gpu, pin_local_gpu

    assert [local_gpu("0,1,2,3,4,5,6,7", str(r)) for r in range(8)] == [str(r) for r in range(8)]
    assert local_gpu("4,5,6,7", "1") == "5" and local_gpu(None, "3") == "3"
    assert local_gpu("6", "3") is None and local_gpu("0,1", None) is None
    with pytest.raises(
        ValueError, match="local rank 2 of 3 process.* needs 3 GPUs, but CUDA_VISIBLE_DEVICES=0,1 lists 2"
    ):
        local_gpu("0,1", "2")
    # 8 processes on 4 GPUs fail on every rank, rank 0 included, before any engine starts
    with pytest.raises(ValueError, match="start at most 4 processes per node"):
        local_gpu("0,1,2,3", "0", 1, "8")
    for env, want in [({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_LOCALID": "3"}, "3"), ({"LOCAL_RANK": "1"}, "1")]:
        for key in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        pin_local_gpu()
        assert os.environ["CUDA_VISIBLE_DEVICES"] == want


def test_a_tensor_parallel_engine_gets_its_own_block_of_gpus():
    """A 72B policy with tensor_parallel_size=4 on an 8-GPU node: 2 ranks, each engine on 4 GPUs of
    its own; 8 ranks of 4 GPUs each are refused with the shape that fits."""
    from mmprm.generation.vllm import local_gpu

    node = "0,1,2,3,4,5,6,7"
    assert [local_gpu(node, str(r), 4, "2") for r in range(2)] == ["0,1,2,3", "4,5,6,7"]
    assert [local_gpu(None, str(r), 2) for r in range(2)] == ["0,1", "2,3"]
    assert local_gpu("4,5", "1", 2) is None  # srun --gpus-per-task=2 narrowed it already
    with pytest.raises(ValueError, match=r"8 process\(es\) per node x tensor_parallel_size 4 needs 32 GPUs.*at most 2"):
        local_gpu(node, "0", 4, "8")
    with pytest.raises(ValueError, match="lower tensor_parallel_size"):
        local_gpu("0,1,2", "0", 4)


def test_whole_solutions_go_to_vllm_in_large_calls_and_to_hf_in_its_batches():
    """vLLM schedules its own batches: Best-of-N must not hand it batch_size // n problems a call
    (4 problems of 16 with the 7B config), which leaves the engine idle at every call's tail."""
    from mmprm.generation.base import problems_per_call

    class Engine:
        sequences_per_call = 8192

    class Rows:
        batch_size = 64

    assert problems_per_call(Engine(), 16, 64) == 512 and problems_per_call(Rows(), 16, 64) == 4
    assert problems_per_call(Rows(), 128, 64) == 1


def test_hf_workers_sample_their_own_streams(toy_policy):
    """worker_seed puts workers 2**40 apart; torch's CPU generator keeps 32 bits of a seed, so
    before torch_cpu_seed two annotation ranks drew the same numbers."""
    from mmprm.generation.base import RolloutRequest, SamplingConfig, worker_seed
    from mmprm.generation.hf import HFBackend

    def sample(worker: int) -> list[str]:
        sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, top_p=1.0, seed=worker_seed(0, worker))
        backend = HFBackend.from_pretrained(toy_policy, sampling, device="cpu", batch_size=8)
        return backend.generate([RolloutRequest("p0", QUESTION, [], [], n=8)])[0]

    first = sample(0)
    assert sample(0) == first  # a worker's own stream is reproducible
    assert sample(1) != first and sample(2) != sample(1)
