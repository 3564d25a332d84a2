"""The Qwen2-VL architecture: logits equal transformers' with random weights (fp32), images and
text in a padded batch; checkpoints load from and save to Hugging Face's format; token ids and
pixels that do not belong together are refused."""

from __future__ import annotations

import pytest
import torch

from miles.errors import MilesError

IMAGE, START, END = 290, 291, 292
PATCH_NUMBERS = 3 * 2 * 14 * 14
VLM_RUN = [  # two RL steps of the built-in VLM (random weights) on the embedded image task
    "--model", "tiny-vlm-random", "--task", "shapes", "--rm-type", "last_number", "--num-rollout", "2",
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
    "--eval-size", "0", "--no-progress",
]  # fmt: skip


def hf_config():
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters=rope, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, vision_start_token_id=START,
        vision_end_token_id=END, video_token_id=293,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' Qwen2-VL with random weights, and miles' model loaded from its checkpoint."""
    from transformers import Qwen2VLForConditionalGeneration

    from miles.models.checkpoint import load_model

    torch.manual_seed(0)
    reference = Qwen2VLForConditionalGeneration(hf_config()).eval()
    path = tmp_path_factory.mktemp("qwen2vl")
    reference.save_pretrained(path)
    return reference, load_model(path).eval(), path


def image_prompt(pre: list[int], grid: tuple[int, int, int], post: list[int]) -> list[int]:
    t, h, w = grid
    return pre + [START] + [IMAGE] * (t * h * w // 4) + [END] + post


def batch():
    """Two left-padded rows: one with two images (4x6 and 2x2 patches), one with a 6x4 image."""
    rows = [
        image_prompt([5, 6], (1, 4, 6), [7, 8]) + [START, IMAGE, END, 9, 10],
        [0, 0, 0, 0, 0, 0] + image_prompt([11], (1, 6, 4), [12, 13, 14]),
    ]
    pad = max(len(r) for r in rows)
    rows = [[0] * (pad - len(r)) + r for r in rows]
    ids = torch.tensor(rows)
    mask = torch.tensor([[0] * (pad - len(r.rstrip())) + [1] * len(r.rstrip()) for r in map(Row, rows)])
    grid = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_NUMBERS)
    return ids, mask, pixels, grid


class Row(list):
    """A padded row's real part: the tokens after the leading zeros."""

    def rstrip(self) -> list[int]:
        first = next(i for i, t in enumerate(self) if t != 0)
        return self[first:]


def test_logits_equal_transformers_for_images_and_text_in_a_padded_batch(pair):
    reference, model, _ = pair
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        want = reference(
            input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(ids == IMAGE).int(),
        ).logits  # fmt: skip
        got = model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid).logits
        real = mask.bool()
        assert (got[real] - want[real]).abs().max() < 1e-5
        text = torch.tensor([[5, 6, 7, 8, 9]])  # no image: M-RoPE is the plain rotation
        assert (model(text).logits - reference(input_ids=text).logits).abs().max() < 1e-5


def test_blank_images_change_the_logits(pair):
    """The image reaches the language model: other pixels, other logits at the text after it."""
    _, model, _ = pair
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        seen = model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid).logits
        blank = model(
            ids, attention_mask=mask, pixel_values=torch.zeros_like(pixels), image_grid_thw=grid
        ).logits
    assert (seen[:, -1] - blank[:, -1]).abs().max() > 1e-3


def test_a_checkpoint_saved_by_miles_loads_in_transformers(pair, tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from miles.models.checkpoint import load_model, save_model

    _, model, _ = pair
    save_model(model, tmp_path / "saved")
    again = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "saved").eval()
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid).logits
        got = again(
            input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(ids == IMAGE).int(),
        ).logits  # fmt: skip
        assert (got[mask.bool()] - want[mask.bool()]).abs().max() < 1e-5
    assert load_model(tmp_path / "saved").config.mrope_section == [2, 3, 3]


@pytest.mark.parametrize(
    "ids, rows, said",
    [
        ([5, START, IMAGE, END, 7], 24, "holds 1 image tokens .* but the images give 6"),
        (image_prompt([5], (1, 4, 6), [7]), 20, "pixel_values has shape"),
    ],
    ids=["placeholder-not-expanded", "pixels-of-another-call"],
)
def test_ids_and_pixels_that_do_not_belong_together_are_refused(pair, ids, rows, said):
    """The processor expands one placeholder into a token per merged patch block; ids that skip
    it (the vision tower would never be seen) or pixels of another call are refused."""
    _, model, _ = pair
    with pytest.raises(MilesError, match=said):
        model(
            torch.tensor([ids]),
            pixel_values=torch.randn(rows, PATCH_NUMBERS),
            image_grid_thw=torch.tensor([[1, 4, 6]]),
        )


def image_requests(groups: int = 3, n: int = 3):
    """`groups` prompts with an image each (sizes differ), n sampled requests per prompt."""
    from miles.rollout.sampling import Request, SamplingParams

    requests, grids = [], [(1, 4, 6), (1, 2, 2), (1, 6, 4), (1, 4, 4)]
    for g in range(groups):
        grid = grids[g % len(grids)]
        torch.manual_seed(10 + g)
        images = {
            "pixel_values": torch.randn(grid[1] * grid[2], PATCH_NUMBERS),
            "image_grid_thw": torch.tensor([grid]),
        }
        ids = image_prompt([5 + g], grid, [7, 8][: 1 + g % 2])
        for k in range(n):
            params = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=100 * g + k)
            requests.append(Request(ids, params, images=images))
    return requests


def test_rollout_logprobs_equal_the_trainers_on_image_prompts(pair):
    """The engine (prefill with the images and M-RoPE, decode from each row's rotary offset)
    reports the log-probs the trainer computes on its own path (micro-batches, pad-free)."""
    from miles.config import make_config
    from miles.rollout.engine import Engine
    from miles.train.policy_trainer import PolicyTrainer

    _, model, _ = pair
    engine = Engine(model, max_batch_size=4, max_seq_len=64, seed=0)  # 9 requests, 4 slots: refills
    assert engine.decode_path.startswith("general")
    samples = engine.generate(image_requests())
    assert all(s.multimodal_train_inputs is not None for s in samples)
    for s in samples:  # an image marker, if sampled, ends the response (it is never fed back)
        response = s.tokens[-s.response_length :]
        assert not {IMAGE, START, END} & set(response[:-1]) and (
            s.response_length == 12 or response[-1] in {IMAGE, START, END}
        )
    assert len({tuple(s.tokens) for s in samples}) > 3
    cfg = make_config({"rollout_temperature": 0.8, "micro_batch_size": 4})
    recomputed = PolicyTrainer(model, cfg).logprobs(samples)
    diff = max(abs(a - float(b)) for s, r in zip(samples, recomputed) for a, b in zip(s.rollout_log_probs, r))
    assert diff < 1e-5, diff


def test_a_request_that_lost_its_images_is_refused(pair):
    """Image tokens reaching the engine without their pixels (slime's blind first turn) raise."""
    from miles.rollout.engine import Engine

    _, model, _ = pair
    request = image_requests(1, 1)[0]
    request.images = None
    with pytest.raises(MilesError, match="image tokens .* but no pixel_values"):
        Engine(model, max_batch_size=2, max_seq_len=64).generate([request])


def test_the_processor_makes_ids_and_pixels_in_one_call(tmp_path):
    """`--task shapes` and a JSONL file with image paths (--multimodal-keys): one call gives the
    ids with one image token per merged block between the markers, and the pixels they stand for."""
    import json

    from miles.data.images import processor_for, shapes_image, shapes_items
    from miles.data.prompts import file_prompts
    from miles.models.tokenizer import BYTE_VISION_IDS

    processor = processor_for("tiny-vlm-random")
    item = shapes_items(1, 0, {})[0]
    ids, images = processor(item.prompt, item.images, chat=False)
    pad, start, end = (BYTE_VISION_IDS[t] for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert ids[:6] == [start, pad, pad, pad, pad, end]  # 56 x 56: 4 x 4 patches, 2 x 2 merged
    assert images["pixel_values"].shape == (16, PATCH_NUMBERS) and images["image_grid_thw"].tolist() == [
        [1, 4, 4]
    ]
    with pytest.raises(MilesError, match="1 <image> placeholder"):
        processor(item.prompt, item.images * 2, chat=False)
    import random

    for k in (1, 3):
        shapes_image(k, random.Random(k)).save(tmp_path / f"{k}.png")
    rows = [{"input": "<image>How many squares?", "label": str(k), "images": [f"{k}.png"]} for k in (1, 3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = file_prompts(tmp_path / "data.jsonl", "input", "label", None, image_key="images")
    ids_file, images_file = processor(items[0].prompt, items[0].images, chat=False)
    assert ids_file == ids and images_file["pixel_values"].shape == (16, PATCH_NUMBERS)


def test_blanked_images_are_seen_by_a_model_that_looks(pair):
    """The blind check's measure: response log-probs move when a model's images are blanked;
    they do not when the images were blank already."""
    from miles.rollout.engine import Engine
    from miles.train.batch import mean_images, vision_sensitivity

    _, model, _ = pair
    samples = Engine(model, max_batch_size=4, max_seq_len=64, seed=0).generate(image_requests(2, 2))
    assert vision_sensitivity(model, samples, 1.0) > 1e-3
    for s in samples:
        s.multimodal_train_inputs = mean_images(s.multimodal_train_inputs)
    assert vision_sensitivity(model, samples, 1.0) < 1e-6  # the mean of equal rows, to rounding


def test_the_doctor_names_a_run_whose_images_were_dropped_blind(tmp_path):
    """`miles train --task shapes` on the tiny VLM, and the same with --debug-blank-images: the
    doctor names the second blind (its images never varied), not the first."""
    from miles.config import load_config
    from miles.doctor.checks import vision_blind
    from miles.doctor.run import load_run
    from miles.run import train

    for name, extra in (("seeing", []), ("blank", ["--debug-blank-images"])):
        train(load_config([*VLM_RUN, *extra, "--output-dir", str(tmp_path / name)]))
    seeing, blank = load_run(tmp_path / "seeing"), load_run(tmp_path / "blank")
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in seeing.steps)  # engine = trainer on images
    assert vision_blind(seeing, None) is None
    cause, evidence, remedies = vision_blind(blank, None)
    assert evidence[0].value < 1e-6 and "remove --debug-blank-images" in remedies[0].why


def test_lora_on_the_vlm_serves_the_adapter_with_the_images(tmp_path):
    """LoRA on the language model of a VLM: the engines serve the merged adapter
    (--check-lora-weight-equal) and their log-probs on image prompts equal the trainer's."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    flags = ["--lora-rank", "4", "--lr", "1e-3", "--check-lora-weight-equal"]
    train(load_config([*VLM_RUN, *flags, "--output-dir", str(tmp_path)]))
    steps = [r for r in read_metrics(tmp_path) if r["rollout"] >= 0]
    assert len(steps) == 2 and all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)


def test_fsdp_on_two_ray_ranks_equals_one_process_on_images(ray_cluster, tmp_path):
    """The VLM trained by FSDP on 2 Ray ranks (each sample's pixels travel with it) equals the
    one-process run."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from tests.conftest import assert_same_run

    train(load_config([*VLM_RUN, "--output-dir", str(tmp_path / "one")]))
    layout = ["--actor-num-gpus-per-node", "2", "--data-parallel", "fsdp"]
    train(load_config([*VLM_RUN, *layout, "--output-dir", str(tmp_path / "fsdp")]))
    assert_same_run(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp"))


def test_a_fully_async_vlm_run_resumes_exactly(tmp_path):
    """Stopped after step 1 and resumed, a fully-async VLM run (image samples cut mid-response and
    carried in the checkpoint with their pixels) equals the uninterrupted one."""
    import shutil

    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from tests.conftest import comparable

    run = [*VLM_RUN, "--num-rollout", "3"]  # the later flag wins
    mode = ["--rollout-mode", "fully-async", "--use-tis", "--over-sampling-batch-size", "6"]
    saving = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    train(load_config([*run, *mode, "--output-dir", str(tmp_path / "ref"), *saving]))
    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "ckpt" / "iter_0000001", stopped / "iter_0000001")
    (stopped / "latest").write_text("1")
    (tmp_path / "run").mkdir()
    lines = (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")  # rollouts 0-1
    train(load_config([*run, *mode, "--output-dir", str(tmp_path / "run"), "--load", str(stopped)]))
    reference, resumed = (
        comparable(read_metrics(tmp_path / "ref")),
        comparable(read_metrics(tmp_path / "run")),
    )
    assert [r["rollout"] for r in resumed] == [r["rollout"] for r in reference] == [0, 1, 2]
    for ref, got in zip(reference, resumed):
        for k in ref:
            if "seconds" not in k and "per_s" not in k:
                assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (ref["rollout"], k)


@pytest.mark.parametrize("fixture, dropped", [("look_twice", False), ("forget_images", True)])
def test_an_image_observation_is_kept_across_turns(tmp_path, monkeypatch, fixture, dropped):
    """A two-turn custom generate function whose second turn shows another image: the sample
    carries both images and the engine's log-probs equal the trainer's over the whole
    conversation. One that re-sends its second turn as text drops the image: the doctor names it."""
    from miles.config import load_config
    from miles.doctor.checks import images_dropped
    from miles.doctor.run import load_run
    from miles.run import train
    from tests.conftest import record_trained

    trained = record_trained(monkeypatch)
    flags = ["--custom-generate-function-path", f"tests.agent_fixtures:{fixture}"]
    train(load_config([*VLM_RUN, *flags, "--output-dir", str(tmp_path)]))
    run = load_run(tmp_path)
    assert (images_dropped(run, None) is not None) == dropped
    if not dropped:
        samples = [s for _, group in trained for s in group]
        assert all(len(s.multimodal_train_inputs["image_grid_thw"]) == 2 for s in samples)
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in run.steps)


def test_images_reach_sglang_servers_as_image_data(tmp_path):
    """--rollout-backend sglang on a `miles serve` process of the VLM: each request sends the
    images as SGLang's image_data beside the expanded ids, the server makes the pixels with the
    model's processor, and the run equals the in-process one."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from tests.conftest import comparable, start_server

    proc, url = start_server(model="tiny-vlm-random")
    try:
        train(load_config([*VLM_RUN, "--output-dir", str(tmp_path / "local")]))
        flags = ["--rollout-backend", "sglang", "--sglang-url", url, "--check-weight-update-equal"]
        train(load_config([*VLM_RUN, *flags, "--output-dir", str(tmp_path / "sglang")]))
    finally:
        proc.kill()
        proc.wait()
    local, remote = (
        comparable(read_metrics(tmp_path / "local")),
        comparable(read_metrics(tmp_path / "sglang")),
    )
    assert len(local) == len(remote) == 2
    for a, b in zip(local, remote):
        for key in ("reward_mean", "response_len_mean", "train_rollout_logprob_abs_diff", "pg_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


def test_a_draft_model_with_a_vlm_is_refused(tmp_path):
    """Speculative drafts never see the images: refused before any work, naming the flag."""
    from miles.config import load_config
    from miles.errors import ConfigError
    from miles.run import train

    with pytest.raises(ConfigError, match="--draft-model with a vision-language model"):
        train(load_config([*VLM_RUN, "--draft-model", "ngram", "--output-dir", str(tmp_path)]))
