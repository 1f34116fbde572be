"""OmegaPRM process-label annotation.

- `search`: the MCTS + binary search for one problem, pure and backend-agnostic (a generator of
  rollout probes).
- `engine`: many searches in flight, their probes batched into one backend call; problems files,
  per-rank resumable tree files, merge (`mmprm merge-annotations`).
- `backends`: `hf` (transformers generate) and `vllm` (offline engine) behind one interface.
- `simulated`: a policy with known per-step error rates (tests, benchmark) and a toy tiny policy.
- `export`: trees -> step-labelled PRM training rows + statistics.
- `judge`: optional LLM judge for answer equivalence over an OpenAI-compatible endpoint.

The entry point is `recipes/mcts_annotate.py`.
"""
