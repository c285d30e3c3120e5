"""GRPO-MA training: ``python -m vlm_grpo_ma.train --task grounding`` (see ``--help``; the CLI is ``cli.py``).

``train()`` is the loop, read top to bottom: draw prompts, sample K thoughts x M answers, score, compute
advantages, build the batch, update, log, evaluate, checkpoint. What it builds first is ``setup.setup_run``;
the update is ``update.update_policy``. Helpers are called, not inherited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import Counter

from vlm_grpo_ma.algorithm.advantages import compute_advantages, informative_prompts
from vlm_grpo_ma.engines.decode import SEED_STRIDE, SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.rollout import Rollout, gather_groups
from vlm_grpo_ma.model import lora
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import EncodedPrompt, encode_prompt
from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import sharding, survive
from vlm_grpo_ma.run.batch import TrainBatch, build_train_batch
from vlm_grpo_ma.run.config import Config, ConfigError
from vlm_grpo_ma.run.distributed import mean_over_processes, sum_over_processes
from vlm_grpo_ma.run.dynamic_sampling import draw_groups, keep_groups
from vlm_grpo_ma.run.held_out import evaluate_during_training
from vlm_grpo_ma.run.rewards import ScoredRollout, add_overlong_penalty, score_rollout
from vlm_grpo_ma.run.run_dir import write_summary
from vlm_grpo_ma.run.setup import RunState, setup_run
from vlm_grpo_ma.run.step_metrics import headline_metrics, rollout_metrics, rollout_records, timing_metrics
from vlm_grpo_ma.run.update import UpdateGuard, update_policy
from vlm_grpo_ma.task_api.images import ImageLoadError
from vlm_grpo_ma.task_api.registry import get_task
from vlm_grpo_ma.task_api.streams import PromptStream
from vlm_grpo_ma.task_api.videos import VideoLoadError

log = logging.getLogger("vlm_grpo_ma.train")
# Steps in a row whose every group had equal rewards (no advantage, nothing trains) before the run says so.
NO_SIGNAL_PATIENCE = 3
_said_broken: set[str] = set()  # the image and video errors already warned about (draw_prompts)


def no_signal_help(cfg: Config) -> str:
    """What a run without learning signal says to do: the guide, and the supervised warm start of its task(s)."""
    modules = "".join(f" --task-module {module}" for module in cfg.data.task_modules)
    commands = " or ".join(f"python -m vlm_grpo_ma.warmstart --task {name}{modules}" for name in cfg.task_weights)
    # the warm start imitates Task.target and refuses a task without one: say so here, not after a second command
    untaught = [name for name in cfg.task_weights if get_task(name).target is None]
    first = f" (first give {', '.join(untaught)} a Task.target, the completion to imitate)" if untaught else ""
    return f"the model may not solve this task yet: see docs/TASKS.md, 'Will my task learn?', or warm-start it on its data: {commands}{first}"


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False, split=None) -> dict:
    """Run ``cfg``'s training; returns the summary (also written to summary.json). ``split``: a trainer's
    (placement, bridge) in a split launch (``split_launch.py``)."""
    run = setup_run(cfg, resume=resume, overwrite=overwrite, split=split)
    accelerator = run.accelerator
    step, guard, completed = run.start_step, UpdateGuard(), run.completed_state()
    steps_in_a_row_without_signal = 0
    # SIGTERM saves and stops like Ctrl-C (exit code 143); several processes stop together (survive.together)
    restore_sigterm = survive.raise_on_sigterm(accelerator.num_processes)
    stopped_alone = False
    try:
        if run.eval_sets and run.start_step == 0:  # the start of the held-out curve: the samples of every later one
            evaluate_before_training(run)
        while step < cfg.train.steps:
            started = time.perf_counter()
            prompts, rollout, scored, rollout_seconds, generated_tokens = sample_step(run, step)
            run.engine.sleep_until_push()  # vllm_sleep: the engine's memory is the update's until the push
            step_counts, steps_in_a_row_without_signal = count_signal(run, scored, steps_in_a_row_without_signal)
            advantages, batch, learning_rate = advantages_and_batch(run, step, rollout, scored)
            update = update_policy(run.scorer, batch, prompts, cfg, accelerator, run.optimizer, run.reference, guard)
            after_update(run, step, update)
            step, guard.weights_changed, completed = step + 1, False, run.completed_state()

            metrics = step_metrics(run, rollout, scored, advantages, batch, update, learning_rate,
                                   seconds=(time.perf_counter() - started, rollout_seconds), step_counts=step_counts,
                                   generated_tokens=generated_tokens)  # fmt: skip
            evaluate_and_log(run, step, metrics, rollout, scored, thought_adv=advantages[0])
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                save_checkpoint(run, step, completed, collective=True)
                with survive.together(accelerator):  # a stop signal that waited for the save
                    pass
    except BaseException as error:
        save_on_the_way_out(run, step, guard, completed, error)  # nothing lost on a crash or Ctrl-C
        stopped_alone = accelerator.num_processes > 1 and not getattr(error, "stopped_together", False)
        raise
    finally:
        restore_sigterm()
        close_run(run, stopped_alone)
    return summarise(run, step)


def evaluate_before_training(run: RunState) -> None:
    """The held-out evaluation before the first step (step 0), recorded with its drawings; the progress bar stays."""
    run.policy.model.eval()
    held_out = evaluate(run, 0)
    if run.accelerator.is_main_process:
        run.logger.log_step(0, held_out, advance=False)
        run.logger.log_drawings(0, eval_folder(run, 0) / "draw")


def count_signal(run: RunState, scored: ScoredRollout, steps_in_a_row_without_signal: int) -> tuple[Counter, int]:
    """Adds the step's counters, summed over the processes (a collective), to ``run.counters``, counting the
    groups and the step without learning signal; warns after ``NO_SIGNAL_PATIENCE`` such steps in a row (fewer
    in a shorter run). Returns (the step's summed counters, the steps in a row without signal, this one included)."""
    cfg = run.cfg
    # groups whose K*M rewards are all equal: every advantage 0, nothing learned from them
    scored.counters["groups_without_signal"] += int((~informative_prompts(scored.rewards)).sum())
    step_counts = sum_over_processes(run.accelerator, scored.counters)
    run.counters.update(step_counts)
    without_signal = step_counts["groups_without_signal"] == cfg.train.prompts_per_step
    run.counters["steps_without_signal"] += int(without_signal)
    steps_in_a_row_without_signal = steps_in_a_row_without_signal + 1 if without_signal else 0
    if steps_in_a_row_without_signal == min(NO_SIGNAL_PATIENCE, cfg.train.steps - run.start_step):
        log.warning(
            "no learning signal: all %d groups had equal rewards in each of the last %d steps, so every"
            " advantage is 0 and nothing trains; %s", cfg.train.prompts_per_step, steps_in_a_row_without_signal,
            no_signal_help(cfg),
        )  # fmt: skip
    return step_counts, steps_in_a_row_without_signal


def advantages_and_batch(run: RunState, step: int, rollout: Rollout, scored: ScoredRollout) -> tuple[tuple, TrainBatch, float]:
    """Step ``step``'s (thought_adv, answer_adv), its training batch and the learning rate its update uses,
    with the model put in training mode; a non-finite input on any process stops every process here."""
    algo = run.cfg.algorithm
    with survive.together(run.accelerator):
        thought_adv, answer_adv = compute_advantages(
            algo.advantage_estimator, scored.rewards, answer_baseline=algo.answer_baseline,
            scale_by_std=algo.scale_by_std, eps=algo.eps, unbiased=algo.std_unbiased,
        )  # fmt: skip
        batch = build_train_batch(rollout, thought_adv, answer_adv, truncated_thoughts=run.cfg.rollout.truncated_thoughts)
        run.policy.model.train()
        learning_rate = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
        survive.check_inputs_finite(step + 1, scored.rewards, (thought_adv, answer_adv), learning_rate)
    return (thought_adv, answer_adv), batch, learning_rate


def after_update(run: RunState, step: int, update: dict) -> None:
    """What follows step ``step``'s update: the weights checked finite, pushed to the engine, the scheduler
    stepped, and ``update`` given the grad norm's spike ratio."""
    # FSDP: each process checks its shards. A stop signal waits for the logging block (evaluate_and_log): the
    # step is complete there, and stopping here would keep the last checkpoint, losing the steps since it.
    with survive.together(run.accelerator, act_on_signals=False):
        survive.check_weights_finite(step + 1, run.policy.model)  # before anything of this step is checkpointed
    run.engine.push_weights(run.policy)  # the next rollout samples from the updated policy
    run.scheduler.step()
    # The grad norm joins the spike history before the step's state is taken: a checkpoint of this
    # step must hold it, or a resumed run's next ratios are computed over a window one step short.
    update["train/grad_norm_spike_ratio"] = run.spikes.observe(update["train/grad_norm"])


def evaluate_and_log(run: RunState, step: int, metrics: dict, rollout: Rollout, scored: ScoredRollout, thought_adv) -> None:
    """After step ``step``: the held-out evaluation when due (its figures join ``metrics``), then, on the main
    process, the step's metrics (every ``logging.log_every``, the last step and each evaluation), the
    evaluation's drawings and the step's rollout samples. A stop signal on any process stops here."""
    cfg, accelerator = run.cfg, run.accelerator
    evaluating = bool(run.eval_sets) and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
    if evaluating:
        metrics.update(evaluate(run, step))
    with survive.together(accelerator):  # the main process's logging; a stop signal on any process
        if accelerator.is_main_process:
            if step % cfg.logging.log_every == 0 or step == cfg.train.steps or evaluating:
                run.logger.log_step(step, metrics)
            if evaluating:  # the drawings of truth and greedy prediction the evaluation wrote
                run.logger.log_drawings(step, eval_folder(run, step) / "draw")
            trees = rollout_records(step, rollout, scored, cfg.logging.rollout_samples_per_step, thought_adv)
            run.logger.log_rollouts(step, trees, [s.images[0] if s.images else None for s in rollout.samples[: len(trees)]])


def close_run(run: RunState, stopped_alone: bool) -> None:
    """The run's teardown, however it ended: the logger, the run folder's lock, the engine, the judge."""
    run.logger.close()
    if run.run_lock is not None:
        run.run_lock.close()
    # the engine ends while the process group still stands (vLLM's teardown destroys it); no teardown when
    # this process stops alone: the others may be waiting in a collective
    run.engine.close(orderly=not stopped_alone)
    if run.judge is not None:
        run.judge.close()


def summarise(run: RunState, steps: int) -> dict:
    """The run's summary after ``steps`` steps (written to summary.json by the main process), and on the main
    process a closing line when some steps had no learning signal."""
    counters, is_main = run.counters, run.accelerator.is_main_process
    summary = write_summary(run.run_dir, headline_metrics(run.tasks), counters, is_main=is_main)
    if counters["steps_without_signal"] and is_main:
        print(f"no learning signal in {counters['steps_without_signal']} of {steps} steps (every group's rewards"
              f" equal, so nothing trained in those steps); {no_signal_help(run.cfg)}", flush=True)  # fmt: skip
    return summary


def sample_step(run: RunState, step: int) -> tuple[list[EncodedPrompt], Rollout, ScoredRollout, float, int]:
    """This process's share of step ``step``: its prompts, their K x M rollout, scored (with DAPO's overlong
    shaping when configured), and the seconds spent drawing and sampling and the tokens generated in them (the
    draws dynamic sampling set aside included, so that tokens per second are of the same work).

    Without ``algorithm.dynamic_sampling``: one draw of ``train.prompts_per_step`` prompts. With it
    (``dynamic_sampling.py``), the step is drawn again, up to ``algorithm.dynamic_sampling_max_draws`` more times,
    until the draws hold ``prompts_per_step`` groups whose task rewards are not all equal; the step trains the
    first of those, filled up with uninformative ones, and every process takes its share. The extra prompts
    drawn (``resampled_prompts``) and the uninformative groups trained are counted. A resumed run is exact: the
    extra draws are part of the stream's position."""
    cfg, algo = run.cfg, run.cfg.algorithm
    share, first = run.prompts_per_process, run.accelerator.process_index * run.prompts_per_process
    engine_first, engine_count = engine_share(run)
    groups, sampling_seconds, generated_tokens, counts = [], 0.0, 0, Counter()
    for draw in range(1 + (algo.dynamic_sampling_max_draws if algo.dynamic_sampling else 0)):
        started = time.perf_counter()
        # Each block between collectives runs in survive.together: an error on one process stops every process.
        samples, prompts, settings = step_prompts(run, step, draw)  # the whole draw, this engine's share encoded
        run.policy.model.eval()  # dropout off while sampling (the tiny model has none; real ones may)
        with policy_sampling(run), survive.together(run.accelerator):
            rollout = run.engine.sample(run.policy, samples[engine_first : engine_first + engine_count],
                                        prompts[engine_first : engine_first + engine_count],
                                        num_thoughts=cfg.rollout.num_thoughts, num_answers=cfg.rollout.num_answers,
                                        settings=settings)  # fmt: skip
        if engine_count != share:  # an engine shared by a group of processes sampled the group's prompts
            rollout = gather_groups([(rollout, b) for b in range(first - engine_first, first - engine_first + share)])
        sampling_seconds += time.perf_counter() - started
        generated_tokens += sum(map(len, rollout.tree.thought_ids)) + sum(map(len, rollout.tree.answer_ids))
        with survive.together(run.accelerator):
            scored = score_rollout(rollout, weight_overrides=cfg.data.reward_weights, workers=cfg.rollout.reward_workers,
                                   truncated_thoughts=cfg.rollout.truncated_thoughts, timeout_s=cfg.rollout.reward_timeout_s,
                                   judge=run.judge)  # fmt: skip
            informative = informative_prompts(scored.rewards)  # on the task's rewards, before the length shaping (as DAPO)
            scored = add_overlong_penalty(
                scored, rollout, max_thought_tokens=cfg.rollout.max_thought_tokens, max_answer_tokens=cfg.rollout.max_answer_tokens,
                thought_buffer=algo.overlong_buffer_thought_tokens, answer_buffer=algo.overlong_buffer_answer_tokens,
                penalty=algo.overlong_penalty, truncated_thoughts=cfg.rollout.truncated_thoughts,
            )  # fmt: skip
        if not algo.dynamic_sampling:
            return rollout.prompts, rollout, scored, sampling_seconds, generated_tokens
        counts.update(scored.counters)
        counts["resampled_prompts"] += share if draw > 0 else 0
        groups += draw_groups(run.accelerator, rollout, scored, informative, samples, prompts)
        if sum(group.informative for group in groups) >= cfg.train.prompts_per_step:
            break
    rollout, scored = keep_groups(groups, cfg.train.prompts_per_step, first, share, counts)
    with survive.together(run.accelerator):  # a group sampled by another process: its prompt is encoded here
        prompts = [p if p is not None else encode_sample(run.policy, s) for p, s in zip(rollout.prompts, rollout.samples, strict=True)]
    return prompts, dataclasses.replace(rollout, prompts=prompts), scored, sampling_seconds, generated_tokens


def engine_share(run: RunState) -> tuple[int, int]:
    """(first prompt, number of prompts) of the step that this process's engine samples: the process's own
    share, or, where a group of ``processes_per_engine`` processes shares one engine (vLLM tensor parallel),
    the group's shares, which every member sends alike."""
    group_size = run.engine.processes_per_engine
    group = run.accelerator.process_index // group_size
    return group * group_size * run.prompts_per_process, group_size * run.prompts_per_process


@contextlib.contextmanager
def policy_sampling(run: RunState):
    """What sampling with the trainer's own model needs (the HF engine): bf16 compute under
    train.mixed_precision=bf16 (weights may be fp32), and FSDP units gathered once for the whole tree. An
    engine holding its own weights (vLLM) gets neither."""
    if not run.engine.samples_with_policy:
        yield
        return
    with sharding.gathered(run.scorer), run.accelerator.autocast():
        yield


def step_prompts(run: RunState, step: int, draw: int = 0) -> tuple[list, list[EncodedPrompt | None], SamplingSettings]:
    """The samples of step ``step``'s ``draw``-th draw (dynamic sampling draws again), all of them, and their
    encoded prompts, of which this process encodes only its engine's share (``engine_share``; the others are
    None), with that share's sampling settings. Every process draws the same samples (same stream, same skips:
    ``draw_prompts``)."""
    cfg, accelerator = run.cfg, run.accelerator
    engine_first, engine_count = engine_share(run)
    samples, prompts = draw_prompts(
        run.stream, cfg.train.prompts_per_step, lambda sample: encode_sample(run.policy, sample), run.counters,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes, exchange=exchange_with(accelerator),
        processes_per_share=run.engine.processes_per_engine,
    )  # fmt: skip
    return samples, prompts, sampling_settings(cfg, step, draw * cfg.train.prompts_per_step + engine_first, engine_count)


def encode_sample(policy: Policy, sample) -> EncodedPrompt:
    """``sample``'s prompt under its task's instruction (ImageLoadError for an image that does not load)."""
    return encode_prompt(policy, sample, get_task(sample.task).instruction)


def exchange_with(accelerator):
    """``exchange(work)`` for ``draw_prompts``: runs this process's ``work()`` (every process stops if one
    raises in it, ``survive.together``) and returns every process's result, in process order."""

    def exchange(work):
        with survive.together(accelerator):
            result = work()
        if accelerator.num_processes == 1:
            return [result]
        from accelerate.utils import gather_object

        return gather_object([result])

    return exchange


def draw_prompts(
    stream: PromptStream, count: int, encode, counters: Counter, *, process_index: int = 0, num_processes: int = 1,
    exchange=lambda work: [work()], processes_per_share: int = 1,
) -> tuple[list, list[EncodedPrompt | None]]:  # fmt: skip
    """The next ``count`` samples of ``stream`` that encode, and their prompts, of which this process encodes
    only its share: slots ``process_index * share ..`` (``share = count // num_processes``); the others are None.
    With ``processes_per_share`` > 1 (processes sharing one engine) each process encodes its group's shares.
    A broken or missing image or video is skipped and counted (``skipped_broken_images``,
    ``skipped_broken_videos``; the log names its path, once per file), never fatal, and every
    process skips the same samples: the samples one process would take, whatever the number of processes.

    Rounds: the next ``count - found`` samples of the stream are candidates; candidate ``j`` fills slot
    ``found + j`` unless an earlier one fails, so the process owning that slot encodes it (each process decodes
    its own images only). ``exchange`` shares the failures (the only collective: one per round); a sample that
    an earlier failure moved into another process's share is encoded again by its new owner."""
    share = (count // num_processes) * processes_per_share
    group = process_index // processes_per_share
    mine = range(group * share, (group + 1) * share)
    samples: list = []
    prompts: dict[int, EncodedPrompt] = {}  # slot -> this process's encoded prompt
    attempts = skipped = 0
    while len(samples) < count:
        found, candidates = len(samples), stream.take(count - len(samples))
        attempts += len(candidates)
        encoded: dict[int, EncodedPrompt] = {}  # candidate -> its prompt, for the candidates of this share
        check = functools.partial(encode_candidates, candidates, [found + j in mine for j in range(len(candidates))], encode, encoded)
        failed = {j: why for part in exchange(check) for j, why in part.items()}
        for counter, why, error in failed.values():
            counters[counter] += 1
            # Warned once per broken file (the error names it), not at each epoch's draw; counted each time. Every
            # process learns every process's failures here, so the main process names them all (the others' logs
            # are quiet: distributed.quiet_other_processes).
            if error not in _said_broken:
                _said_broken.add(error)
                log.warning("%s", why)
        skipped += len(failed)
        if failed and attempts > 10 * count + 100:
            raise ConfigError(f"too many unreadable images or videos in a row; check data.source ({next(iter(failed.values()))[1]})")
        for j, sample in enumerate(candidates):
            if j not in failed:
                if j in encoded and len(samples) in mine:
                    prompts[len(samples)] = encoded[j]
                samples.append(sample)
    if skipped:  # every process knows the failures, so every process takes part (or none does)

        def fill() -> dict:
            for slot in mine:  # a sample another process checked, moved into this share by a failure before it
                if slot not in prompts:
                    prompts[slot] = encode(samples[slot])
            return {}

        exchange(fill)
    return samples, [prompts.get(slot) for slot in range(count)]


def encode_candidates(candidates: list, is_mine: list[bool], encode, encoded: dict) -> dict[int, tuple[str, str, str]]:
    """Encode the candidates ``j`` with ``is_mine[j]`` into ``encoded[j]``; returns {j: (the counter it adds
    to, why, the error)} for those that do not load."""
    failures = {}
    for j, sample in enumerate(candidates):
        if is_mine[j]:
            try:
                encoded[j] = encode(sample)
            except ImageLoadError as error:
                counter = "skipped_broken_videos" if isinstance(error, VideoLoadError) else "skipped_broken_images"
                failures[j] = (counter, f"skipping sample {sample.id}: {error}", str(error))
    return failures


def sampling_settings(cfg: Config, step: int, first_prompt: int, num_prompts: int) -> SamplingSettings:
    """How step ``step`` samples prompts ``first_prompt ..`` of the step (a later draw of the step numbers its
    prompts after the earlier draws'). The randomness is a function of (seed, step, prompt): a resumed run
    samples the same trees, and so does a run split over processes."""
    return SamplingSettings(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_thought_tokens=cfg.rollout.max_thought_tokens,
        max_answer_tokens=cfg.rollout.max_answer_tokens,
        thought_stop=cfg.rollout.thought_stop,
        answer_stop=cfg.rollout.answer_stop,
        max_turns=cfg.rollout.max_turns,
        generators=prompt_generators(cfg.train.seed * SEED_STRIDE + step, first_prompt, num_prompts),
    )


def step_metrics(
    run: RunState, rollout: Rollout, scored: ScoredRollout, advantages: tuple, batch: TrainBatch, update: dict,
    learning_rate: float, seconds: tuple[float, float], step_counts: Counter, generated_tokens: int,
) -> dict:
    """The step's figures, averaged over the processes (``distributed.mean_over_processes``). ``seconds``: the
    step's and its rollout's wall time; ``step_counts``: this step's counters, summed over the processes;
    ``generated_tokens``: this process's, in every draw of the step."""
    metrics = rollout_metrics(rollout, scored, *advantages, run.tasks)
    if run.cfg.algorithm.dynamic_sampling:
        metrics["signal/resampled_prompts"] = step_counts["resampled_prompts"]
        metrics["signal/uninformative_groups_trained"] = step_counts["uninformative_groups_trained"]
    metrics.update(update)
    if run.judge is not None:
        metrics.update(judge_metrics(step_counts, scored.judge_seconds))
    if run.engine.metrics_prefix:  # vLLM in a launch: each process's gap under its name too
        metrics[run.engine.metrics_prefix + "logprob_gap_max"] = metrics["rollout/logprob_gap_max"]
    metrics.update(sharding.state_bytes(run.policy.model, run.optimizer, run.accelerator.process_index, getattr(run.reference, "module", None)))
    metrics.update(timing_metrics(batch, *seconds, generated_tokens))
    # vllm: rollout/prefix_cache_hit_rate; engine processes: staleness, idle seconds, their own sampling speed
    metrics.update(run.engine.step_metrics())
    metrics.update(
        {
            "train/learning_rate": learning_rate,
            "data/epoch": run.stream.epoch,
            **{f"count/{k}": v for k, v in run.counters.items()},
        }
    )
    return mean_over_processes(run.accelerator, metrics)


def judge_metrics(step_counts: Counter, seconds: float) -> dict[str, float]:
    """The served judge's step, over the processes (``step_counts``) and this process's wait (``seconds``):
    answers that asked for a verdict, requests sent (retries included), the share of judged answers the cache or an identical answer served,
    answers left without a verdict (failed, unreadable) and answers over the length cap."""
    asked = step_counts["judge_queries"] - step_counts["judge_overlong"]
    return {
        "judge/queries": step_counts["judge_queries"],
        "judge/requests": step_counts["judge_requests"],
        "judge/cache_hit_rate": step_counts["judge_cache_hits"] / asked if asked else 0.0,
        "judge/failures": step_counts["judge_failures"],
        "judge/unreadable": step_counts["judge_unreadable"],
        "judge/overlong": step_counts["judge_overlong"],
        "judge/seconds": seconds,
    }


def evaluate(run: RunState, step: int) -> dict[str, float]:
    """Held-out evaluation after ``step`` steps (0: before the first); records in ``eval/step-NNNNNN/``."""
    return evaluate_during_training(run.policy, run.scorer, run.accelerator, run.eval_sets, run.cfg, eval_folder(run, step), run.judge)


def eval_folder(run: RunState, step: int):
    return run.run_dir / "eval" / f"step-{step:06d}"


def save_checkpoint(run: RunState, step: int, completed: dict, *, collective: bool) -> None:
    """Checkpoint ``step``: weights, optimizer, scheduler, and ``completed`` (data position, counters and spike
    history as they were when step ``step`` ended). Collective under FSDP (every process writes its optimizer
    shard; ``sharding.save_checkpoint``), else written by the main process. ``collective``: every process calls
    this at the same point, so a write failing on the main process stops them all (``survive.together``);
    False only where the other processes may not be here (the way out of an error on one process alone)."""
    cfg, policy = run.cfg, run.policy
    if run.fsdp is not None:
        training_state = {"scheduler": run.scheduler.state_dict(), **completed}
        sharding.save_checkpoint(
            run.scorer, policy, run.optimizer, run.run_dir, step, training_state=training_state,
            keep=cfg.train.keep_checkpoints, accelerator=run.accelerator,
        )  # fmt: skip
        return

    def write_model(folder) -> None:
        lora.save_model(policy, folder)
        policy.processor.save_pretrained(folder)

    with survive.together(run.accelerator, act_on_signals=False) if collective else contextlib.nullcontext():
        if run.accelerator.is_main_process:
            ckpt.save_checkpoint(
                run.run_dir,
                step,
                write_model=write_model,
                training_state={"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), **completed},
                keep=cfg.train.keep_checkpoints,
            )


def save_on_the_way_out(run: RunState, step: int, guard: UpdateGuard, completed: dict, error: BaseException) -> None:
    """On a crash, Ctrl-C or SIGTERM: checkpoint the steps done since the last checkpoint, unless the weights
    belong to no step (an optimiser step of the unfinished step ran) or saving would wait on failed processes
    (FSDP saves collectively: only after a stop every process made at the same point, survive.together)."""
    last_saved = ckpt.latest_checkpoint(run.run_dir)
    if guard.weights_changed:  # an optimiser step of the unfinished step ran: the weights match no step
        log.error("interrupted while updating step %d: keeping the last checkpoint (%s)", step + 1, last_saved)
    elif run.fsdp is not None and not getattr(error, "stopped_together", False):
        log.error("interrupted after step %d: FSDP run stopped on one process only, no checkpoint on the way out "
                  "(last: %s)", step, last_saved)  # fmt: skip
    elif step > run.start_step and (last_saved is None or not last_saved.name.endswith(f"{step:06d}")):
        log.error("interrupted after step %d: saving a checkpoint before exiting", step)
        save_checkpoint(run, step, completed, collective=getattr(error, "stopped_together", False))
    if getattr(error, "stopped_together", False):
        # no process exits before the checkpoint is written: the launcher stops the others when one exits
        run.accelerator.wait_for_everyone()

