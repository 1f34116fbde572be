"""mmprm.data.score_cache: a real tiny PRM behind the cache, its calls counted."""

from __future__ import annotations

import math

import pytest

from mmprm.config import ConfigError
from mmprm.data.schema import StepExample
from mmprm.data.score_cache import CachedScorer, example_key

EXAMPLES = [
    {"question": "What is 2 + 3?", "steps": ["2 + 3 = 5.", "The answer is 5."]},
    {"question": "What is 4 - 1?", "steps": ["4 - 1 = 2.", "So 2.", "The answer is 2."]},
    {"question": "What is 4 - 1?", "steps": ["4 - 1 = 3."]},
]


@pytest.fixture(scope="module")
def prm_dir(tiny_model_dir, tmp_path_factory):
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    backbone, processor = load_backbone(tiny_model_dir("qwen2"))
    return save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path_factory.mktemp("prm") / "prm")


class Counted:
    """Loads the real PRM and records how many examples each `score` call got."""

    def __init__(self, prm_dir, **kwargs):
        self.prm_dir, self.kwargs, self.loads, self.calls = prm_dir, kwargs, 0, []

    def __call__(self):
        from mmprm import load_prm

        self.loads += 1
        prm = load_prm(self.prm_dir, device="cpu", **self.kwargs)
        score = prm.score

        def counted(examples, **kw):
            self.calls.append(len(examples))
            return score(examples, **kw)

        prm.score = counted
        return prm


def test_scores_are_the_prms_and_each_example_is_scored_once(prm_dir, tmp_path):
    from mmprm import load_prm

    direct = load_prm(prm_dir, device="cpu").score(EXAMPLES)
    load = Counted(prm_dir)
    cache = CachedScorer(tmp_path / "score_cache.jsonl", load, prm=prm_dir)
    got = cache.score([EXAMPLES[0], EXAMPLES[1], EXAMPLES[0]])  # a repeat is scored once
    assert load.calls == [2]
    assert got[0] == got[2] and got[:2] == [pytest.approx(d, abs=1e-6) for d in direct[:2]]
    assert cache.missing(EXAMPLES) == [EXAMPLES[2]]
    assert cache.score(EXAMPLES)[2] == pytest.approx(direct[2], abs=1e-6) and load.calls == [2, 1]
    cache.close()
    assert len((tmp_path / "score_cache.jsonl").read_text().splitlines()) == 3

    # a new run on the same file: everything from the file, the PRM never loaded
    again = CachedScorer(tmp_path / "score_cache.jsonl", lambda: pytest.fail("loaded"), prm=prm_dir)
    assert len(again) == 3 and again.score(EXAMPLES) == cache.score(EXAMPLES)


def test_a_torn_row_is_scored_again_and_other_settings_are_refused(prm_dir, tmp_path):
    path = tmp_path / "score_cache.jsonl"
    first = CachedScorer(path, Counted(prm_dir), prm=prm_dir)
    scores = first.score(EXAMPLES)
    first.close()
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:15])  # killed while writing the third row
    load = Counted(prm_dir)
    resumed = CachedScorer(path, load, prm=prm_dir)
    assert resumed.score(EXAMPLES) == [pytest.approx(s, abs=1e-6) for s in scores] and load.calls == [1]
    resumed.close()
    with pytest.raises(ConfigError, match=r"score_cache\.jsonl was made with other settings .*'max_length'"):
        CachedScorer(path, Counted(prm_dir), prm=prm_dir, max_length=16)


def test_steps_cut_by_max_length_stay_nan_through_the_file(prm_dir, tmp_path):
    path = tmp_path / "score_cache.jsonl"
    cut = CachedScorer(path, Counted(prm_dir, max_length=40), prm=prm_dir, max_length=40)
    scores = cut.score([EXAMPLES[1]])[0]
    cut.close()
    assert math.isnan(scores[-1]) and not math.isnan(scores[0])
    reread = CachedScorer(path, lambda: pytest.fail("loaded"), prm=prm_dir, max_length=40).score([EXAMPLES[1]])[0]
    assert math.isnan(reread[-1]) and reread[0] == scores[0]


def test_the_key_is_what_the_prm_sees():
    ex = StepExample(id="a", question="Q?", steps=["s1", "s2"], images=["img/1.png"], labels=[1.0, 0.0])
    same = {"id": "b", "question": "Q?", "steps": ["s1", "s2"], "images": ["img/1.png"]}
    assert example_key(ex) == example_key(same)  # ids and labels are not scored
    assert example_key(ex) != example_key({**same, "images": []})
    assert example_key(ex) != example_key({**same, "steps": ["s1 ", "s2"]})
    assert example_key({**same, "steps": ["s1", "s2"]}) != example_key({**same, "steps": ["s1s2"]})
    from PIL import Image

    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    assert example_key({**same, "images": [red]}) == example_key({**same, "images": [red.copy()]})
    assert example_key({**same, "images": [red]}) != example_key({**same, "images": [blue]})
