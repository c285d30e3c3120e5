"""Host memory over a long image stream: a sample keeps its image's encoded bytes, never its decoded pixels, and
each process decodes only its own share of a step's prompts (the RSS figure: ``python -m vlm_grpo_ma.bench
image-stream``)."""

import io
import threading

from PIL import Image

from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run.loop import draw_prompts
from vlm_grpo_ma.task_api.images import ImageLoadError, open_lazily
from vlm_grpo_ma.task_api.registry import Sample
from vlm_grpo_ma.task_api.streams import PromptStream


def _jpeg(width=96, height=64) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 40)).save(out, "JPEG")
    return out.getvalue()


def test_encoding_a_prompt_leaves_its_lazily_opened_image_undecoded(tiny_policy):
    """A parquet image cell is opened lazily (header only); encoding the prompt decodes a copy that goes with the
    step. Planted and seen to fail: decode_image calling convert("RGB") on the sample's own image (its pixels
    were then loaded into it: tile [], _im set)."""
    image = open_lazily(_jpeg(), "cell")
    sample = Sample("grounding", "s", "the red box", (image,), [0, 0, 1, 1])
    encoded = encode_prompt(tiny_policy, sample, "Answer.")
    assert encoded.original_sizes == ((96, 64),) and encoded.pixel_values.shape[0] > 0
    assert sample.images[0].tile, "the sample's image was decoded in place (its pixels stay for the whole run)"
    assert getattr(sample.images[0], "_im", None) is None
    encode_prompt(tiny_policy, sample, "Answer.")  # a later epoch decodes the same bytes again
    assert sample.images[0].tile


def _samples(count: int) -> list[Sample]:
    return [Sample("t", f"s{i}", "q", (f"img{i}",), None) for i in range(count)]


def _recording_encoder(broken: set[str], seen: list[str]):
    def encode(sample):
        seen.append(sample.id)
        if sample.id in broken:
            raise ImageLoadError(f"{sample.id} is broken")
        return f"prompt of {sample.id}"

    return encode


def _two_processes(samples, count, broken):
    """draw_prompts on two threads standing for two processes, exchanging through a barrier as gather_object
    does; returns each process's (samples, prompts, encoded ids, counters)."""
    barrier, posted, results = threading.Barrier(2, timeout=10), [None, None], [None, None]

    def process(rank):
        def exchange(work):
            posted[rank] = work()
            barrier.wait()
            everyone = list(posted)
            barrier.wait()
            return everyone

        seen, counters = [], {"skipped_broken_images": 0}
        stream = PromptStream(samples, seed=3)
        got = draw_prompts(stream, count, _recording_encoder(broken, seen), counters, process_index=rank,
                           num_processes=2, exchange=exchange)  # fmt: skip
        results[rank] = (*got, seen, counters, stream.position)

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert all(result is not None for result in results)
    return results


def test_each_process_decodes_its_own_share_and_every_process_takes_what_one_process_takes():
    """4 prompts a step on 2 processes (shares of 2): the step's draw is the same on both and equals one
    process's; each process encodes its own 2 prompts only. With the second drawn sample broken, the third moves
    into process 0's share (process 1 checked it, process 0 encodes it again) and process 1 takes the fifth:
    process 0 decodes {1st, 2nd, 3rd}, process 1 {3rd, 4th, 5th}, not all five each. Planted and seen to fail:
    every process encoding the whole draw (as before: process 0 saw 4 samples, not 2), and each process acting on
    its own failures only (process 0 drew a second round, process 1 did not: a hang, here a broken barrier)."""
    samples = _samples(12)
    order = PromptStream(samples, seed=3).take(12)  # the stream's order, as one process draws it
    first = [s.id for s in order]

    seen_one, counters_one = [], {"skipped_broken_images": 0}
    stream = PromptStream(samples, seed=3)
    one_samples, one_prompts = draw_prompts(stream, 4, _recording_encoder(set(), seen_one), counters_one)
    assert [s.id for s in one_samples] == first[:4] and one_prompts == [f"prompt of {i}" for i in first[:4]]
    (s0, p0, seen0, _, _), (s1, p1, seen1, _, _) = _two_processes(samples, 4, broken=set())
    assert s0 == s1 == one_samples
    assert p0 == [*one_prompts[:2], None, None] and p1 == [None, None, *one_prompts[2:]]
    assert seen0 == first[:2] and seen1 == first[2:4]

    broken = {first[1]}
    seen_one, counters_one = [], {"skipped_broken_images": 0}
    stream_one = PromptStream(samples, seed=3)
    one_samples, one_prompts = draw_prompts(stream_one, 4, _recording_encoder(broken, seen_one), counters_one)
    expected = [first[0], first[2], first[3], first[4]]
    assert [s.id for s in one_samples] == expected and counters_one["skipped_broken_images"] == 1
    (s0, p0, seen0, c0, pos0), (s1, p1, seen1, c1, pos1) = _two_processes(samples, 4, broken)
    assert [s.id for s in s0] == [s.id for s in s1] == expected
    assert p0 == [*one_prompts[:2], None, None] and p1 == [None, None, *one_prompts[2:]]
    assert sorted(seen0) == sorted(first[:3]) and sorted(seen1) == sorted(first[2:5])
    assert c0 == c1 == counters_one  # every process counts the step's skipped images
    assert pos0 == pos1 == stream_one.position == 5
