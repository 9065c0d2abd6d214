"""Multi-turn rollouts: engine generation and environment steps alternating per trajectory.

Each trajectory (a prompt × ``n_samples_per_prompt``) owns one environment object
(a ``skyrl_gym`` ``BaseTextEnv``, made by :func:`mlora.rollout.gym.make_text_env`). A turn is one batched generation call over every trajectory
still running (so trajectories wait only for the turn in flight, not for another's whole episode; the
call is split over the rank's engines), then each environment's ``step`` on its model's text (in a pool
of ``max_env_workers`` threads when asked). What the environment answers becomes tokens
(:class:`TurnFormat`) appended to the trajectory; the next turn's prompt is the whole sequence.

A trajectory comes back as one :class:`~mlora.rollout.generator.Generation` whose ``token_ids`` are
every token after the prompt, with ``extra``:

- ``model_mask``: 1 on the model's tokens, 0 on the environment's (they carry log-prob 0 and stay out
  of every loss, the advantages and the vLLM-vs-trainer gap);
- ``turn_rewards`` and ``turn_ends`` (index in ``token_ids`` of each turn's last model token), from
  which the trainer places per-token rewards (``generator.turn_rewards``);
- ``turns``, ``end_reason`` (``done``, ``max_turns``, ``length``, ``env_error: ...``, ``malformed: ...``);
- ``env_class``, ``env_metrics`` (the environment's ``get_metrics()`` when its episode ended; aggregated per
  environment class by :func:`episode_metrics`), and ``failure`` (environment id, turn, traceback) when the
  environment failed.

As in SkyRL, a step's ``postprocessed_action`` replaces the model's text of that turn (re-tokenized; still
the model's tokens, but with log-prob 0 where they differ from what the engine sampled). An environment that
raises (in construction, ``init``, ``step``, ``get_metrics``) or returns malformed output ends its
trajectory (reward 0 for that turn, the reason and traceback kept); :func:`check_env_failures` then stops the
run with a report unless the share of such trajectories is within the tolerated one. A trajectory whose next
prompt would exceed ``max_input_length`` ends as ``length`` (its ``finish_reason`` too, as SkyRL's
``stop_reason``).

``use_conversation_multi_turn=false`` (or a tokenizer without a chat template) keeps the whole trajectory in one
assistant message, as SkyRL: a turn's closing EOS is dropped when the episode goes on, the observations'
contents are appended as they are, and a trajectory that ends with neither an EOS nor a length cut gets one
(trained, log-prob 0, carrying the last turn's reward).
"""

from __future__ import annotations

import copy
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

from skyrl_gym.envs.base_text_env import BaseTextEnv

from mlora.rollout.generator import Generation, SamplingConfig
from mlora.rollout.gym import aggregate_env_metrics, check_step_output, plain_metrics

TURN_SEED_STRIDE = 100_003  # turn t samples with seed + t·stride (+ the trajectory's place in the call)
END_REASONS = ("done", "max_turns", "length", "env_error", "malformed")
FAILURES = ("env_error", "malformed")  # end reasons that are the environment's fault
TURN_REWARDS = ("turn_end", "final")  # generator.turn_rewards: where a trajectory's turn rewards are placed


class TurnFormat:
    """Tokens of what the environment says between two model turns, as SkyRL's generator makes them
    (``skyrl_gym_generator.py``).

    ``conversation=True`` (SkyRL's ``use_conversation_multi_turn``) with a tokenizer that has a chat template:
    SkyRL's fixed base conversation ``[system, user]`` is rendered to tokens and cut after its last EOS; a turn's
    observations are the tokens of ``base + observations`` (with the generation prompt) past that base, so
    what the template puts after an end of turn (ChatML's newline) comes with them. The model's turn stays as
    it was sampled, except that a turn which ended on one of ``stop`` (a stop string, not EOS) gets EOS
    appended when ``append_eos_after_stop`` (SkyRL's ``append_eos_token_after_stop_str_in_multi_turn``); a turn
    cut at the length limit gets nothing. Otherwise (no template, or ``conversation=False``): one assistant
    message goes on, the model's EOS dropped (:meth:`open_turn`) and the observations' contents appended as they
    are (SkyRL's ``use_conversation_multi_turn=false``)."""

    BASE = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "I am a user."}]

    def __init__(self, tokenizer, conversation: bool = True, stop: Sequence[str] | None = None,
                 append_eos_after_stop: bool = True) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.chat = bool(conversation and getattr(tokenizer, "chat_template", None))
        self.stop = tuple(stop or ())
        self.append_eos_after_stop = append_eos_after_stop
        self.base_ids: list[int] = []
        if self.chat:
            base = self._render(self.BASE, False)
            ends = [i for i, t in enumerate(base) if t == self.eos]
            self.base_ids = base[:ends[-1] + 1] if ends else base
            probe = self._render(self.BASE + [{"role": "user", "content": "An observation."}], True)
            if probe[:len(self.base_ids)] != self.base_ids:
                raise ValueError("the chat template renders SkyRL's base conversation [system, user] differently when "
                                 "a message follows, so observations cannot be cut from it: give a template that "
                                 "renders a conversation's start the same however it goes on (generator."
                                 "chat_template), or set generator.use_conversation_multi_turn=false to append "
                                 "observations as text")

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=False))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def open_turn(self, action_ids: Sequence[int]) -> int:
        """How many of the turn's last model tokens leave the trajectory before the observations: its EOS when
        the conversation stays one assistant message (the message goes on, so SkyRL drops the EOS)."""
        return int(not self.chat and bool(action_ids) and action_ids[-1] == self.eos)

    def close_turn(self, action_ids: Sequence[int], text: str = "") -> list[int]:
        """Tokens that end the model's turn before the observations: EOS after a turn that stopped on a stop
        string (SkyRL's ``append_eos_token_after_stop_str_in_multi_turn``), nothing else."""
        if (self.chat and self.append_eos_after_stop and self.stop and self.eos is not None and text.endswith(self.stop)
                and not (action_ids and action_ids[-1] == self.eos)):
            return [self.eos]
        return []

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The observations as tokens, ready for the model's next turn."""
        if not self.chat:
            return [t for m in messages for t in self._encode(m["content"])]
        if not messages:
            return self._render(self.BASE, True)[len(self._render(self.BASE, False)):]  # the generation prompt
        return self._render(self.BASE + list(messages), True)[len(self.base_ids):]


@dataclass
class _Trajectory:
    prompt_index: int
    ids: list[int]  # the whole sequence so far
    prompt_length: int
    env: BaseTextEnv | None
    env_class: str | None = None
    mask: list[int] = field(default_factory=list)  # over ids[prompt_length:]
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    finish_reason: str = ""
    end_reason: str | None = None
    failure: dict | None = None  # where and how the environment failed (check_env_failures reports it)
    env_metrics: dict = field(default_factory=dict)

    def fail(self, reason: str, turn: int) -> None:
        """Record the environment failure being handled (call inside its ``except``)."""
        self.end_reason = reason
        self.failure = {"env_class": self.env_class, "turn": turn, "traceback": traceback.format_exc()[-4000:]}

    def add(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.mask.extend([int(model)] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def drop_last(self, n: int) -> None:
        """The last ``n`` tokens leave the trajectory."""
        if n:
            del self.ids[-n:], self.mask[-n:], self.logprobs[-n:]

    def replace_action(self, old: Sequence[int], new: list[int]) -> None:
        """The last turn's model tokens ``old`` become ``new`` (a ``postprocessed_action``); tokens past the
        common prefix have no engine log-prob: 0."""
        keep = 0
        while keep < min(len(old), len(new)) and old[keep] == new[keep]:
            keep += 1
        start = len(self.ids) - len(old)
        logprobs = self.logprobs[len(self.logprobs) - len(old):][:keep] + [0.0] * (len(new) - keep)
        del self.ids[start:], self.mask[len(self.mask) - len(old):], self.logprobs[len(self.logprobs) - len(old):]
        self.add(new, True, logprobs)

    def result(self, text: str) -> Generation:
        extra = {"model_mask": self.mask, "turn_rewards": self.turn_rewards, "turn_ends": self.turn_ends,
                 "turns": len(self.turn_rewards), "end_reason": self.end_reason, "env_class": self.env_class,
                 "env_metrics": self.env_metrics}
        if self.failure is not None:
            extra["failure"] = self.failure
        return Generation(self.prompt_index, self.ids[self.prompt_length:], self.logprobs, text, self.finish_reason,
                          extra)


def _error(kind: str, exc: BaseException) -> str:
    return f"{kind}: {type(exc).__name__}: {exc}"[:300]


def run_episodes(generate: Callable[[list[list[int]], SamplingConfig], list[Generation]], prompts: Sequence,
                 sampling: SamplingConfig, make_env: Callable[[object], BaseTextEnv], fmt: TurnFormat,
                 max_turns: int, max_input_length: int, prompt_ids: Callable[[object, list], list[int]],
                 env_workers: int = 1) -> list[Generation]:
    """``n_samples_per_prompt`` multi-turn trajectories per prompt, grouped by prompt in prompt order.

    ``generate(sequences, sampling)``: one sample per sequence, in order (the engines); ``prompts``: objects
    with ``token_ids`` and ``row`` (:class:`~mlora.rollout.data.Prompt`); ``make_env(prompt)``: a fresh
    environment for one trajectory; ``prompt_ids(prompt, conversation)``: the tokens of a conversation that
    ``init`` changed. A trajectory ends when its environment says done, after ``max_turns`` turns, or when
    its next prompt would pass ``max_input_length`` tokens."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    trajectories = []
    for p_index, prompt in enumerate(prompts):
        for _ in range(sampling.n_samples_per_prompt):
            t = _Trajectory(p_index, list(prompt.token_ids), len(prompt.token_ids), None,
                            getattr(prompt, "env_class", None))
            try:
                t.env = make_env(prompt)
                conversation = prompt.row.get("prompt")
                start, _ = t.env.init(copy.deepcopy(conversation))
                if start != conversation:
                    t.ids = list(prompt_ids(prompt, start))
                    t.prompt_length = len(t.ids)
            except Exception as exc:  # noqa: BLE001 — counted and reported by check_env_failures
                t.fail(_error("env_error", exc), 0)  # the trajectory gets its first turn, then ends with reward 0
            trajectories.append(t)
    pool = ThreadPoolExecutor(env_workers) if env_workers > 1 else None
    try:
        active = list(trajectories)
        for turn in range(max_turns):
            if not active:
                break
            s = replace(sampling, n_samples_per_prompt=1,
                        seed=None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE)
            gens = generate([t.ids for t in active], s)
            if len(gens) != len(active):
                raise RuntimeError(f"the engines returned {len(gens)} generations for {len(active)} trajectories")
            for t, g in zip(active, gens):
                t.add(g.token_ids, True, g.logprobs)
                t.turn_ends.append(len(t.mask) - 1)
                t.finish_reason = g.finish_reason
            texts = [g.text for g in gens]
            steps = list(pool.map(_step, active, texts) if pool else map(_step, active, texts))
            still = []
            for t, g, (obs, reward, done, reason, action) in zip(active, gens, steps):
                t.turn_rewards.append(reward)
                action_ids = list(g.token_ids)
                if action is not None:  # SkyRL's postprocessed_action: the turn as the environment rewrote it
                    ends = bool(action_ids) and action_ids[-1] == fmt.eos
                    new = fmt.tokenizer(action, add_special_tokens=False)["input_ids"] + ([fmt.eos] if ends else [])
                    t.replace_action(action_ids, new)
                    t.turn_ends[-1] = len(t.mask) - 1
                    action_ids = new
                if reason is None and not done and turn + 1 >= max_turns:
                    reason = "max_turns"
                if reason is None and not done:
                    try:
                        more = fmt.close_turn(action_ids, g.text) + fmt.observation_ids(obs)
                    except Exception as exc:  # noqa: BLE001
                        t.fail(_error("malformed", exc), turn + 1)
                        reason = t.end_reason
                    else:
                        t.drop_last(fmt.open_turn(action_ids))
                        t.turn_ends[-1] = len(t.mask) - 1
                        if len(t.ids) + len(more) > max_input_length:
                            reason = t.finish_reason = "length"  # SkyRL's stop_reason for the context cut
                        else:
                            t.add(more, False)
                            still.append(t)
                            continue
                t.end_reason = reason or "done"
                if not fmt.chat and t.finish_reason != "length" and t.ids[-1:] != [fmt.eos] and fmt.eos is not None:
                    t.add([fmt.eos], True)  # one assistant message ends with EOS (SkyRL appends and trains it)
                    t.turn_ends[-1] = len(t.mask) - 1
            active = still
    finally:
        if pool is not None:
            pool.shutdown()
        for t in trajectories:
            if t.env is not None:
                if t.failure is None:
                    try:  # SkyRL: after the episode, before close
                        t.env_metrics = plain_metrics(t.env.get_metrics())
                    except Exception as exc:  # noqa: BLE001
                        t.fail(_error("env_error", exc), len(t.turn_rewards))
                try:
                    t.env.close()
                except Exception:  # noqa: BLE001 — nothing to keep from a failing close
                    pass
    return [t.result(fmt.tokenizer.decode(t.ids[t.prompt_length:])) for t in trajectories]


def _step(t: _Trajectory, text: str) -> tuple[list, float, bool, str | None, str | None]:
    """``(observations, reward, done, end reason or None, postprocessed action or None)`` of one environment
    step, faults caught and recorded on ``t``."""
    if t.end_reason is not None:  # init failed: this first turn is its last
        return [], 0.0, True, t.end_reason, None
    turn = len(t.turn_rewards) + 1
    try:
        out = t.env.step(text)
    except Exception as exc:  # noqa: BLE001
        t.fail(_error("env_error", exc), turn)
        return [], 0.0, True, t.end_reason, None
    try:
        step = check_step_output(out)
    except ValueError as exc:
        t.fail(f"malformed: {exc}"[:300], turn)
        return [], 0.0, True, t.end_reason, None
    return step.observations, step.reward, step.done, None, step.postprocessed_action


def end_reason_counts(gens: Sequence[Generation]) -> dict[str, int]:
    """How many trajectories ended for each reason (errors by their kind: ``env_error``, ``malformed``)."""
    out = {k: 0 for k in END_REASONS}
    for g in gens:
        reason = str(g.extra.get("end_reason") or "done")
        out[reason.split(":", 1)[0]] += 1
    return out


def episode_metrics(gens: Sequence[Generation]) -> dict[str, float]:
    """SkyRL's ``environment/<key>`` metrics: each environment class's ``aggregate_metrics`` over the
    ``get_metrics()`` of its episodes in ``gens``."""
    by_class: dict[str, list[dict]] = defaultdict(list)
    for g in gens:
        if g.extra.get("env_class") and "failure" not in g.extra:
            by_class[g.extra["env_class"]].append(g.extra.get("env_metrics") or {})
    out: dict[str, float] = {}
    for name, metrics in by_class.items():
        out.update({f"environment/{k}": v for k, v in aggregate_env_metrics(name, metrics).items()})
    return out


class EnvironmentFailure(RuntimeError):
    """More trajectories than tolerated ended by their environment's fault (the message is the report)."""


class FailureCount(NamedTuple):
    failed: int
    total: int
    first: str | None  # the report of the first failure, None when none


def check_env_failures(gens: Sequence[Generation], max_ratio: float, prompts: Sequence | None = None
                       ) -> FailureCount:
    """The trajectories of ``gens`` whose environment raised or returned malformed output; EnvironmentFailure
    with a report of the first (environment id, turn, prompt, trajectory text, traceback) when their share
    exceeds ``max_ratio`` (``environment.max_env_error_ratio``; 0: any failure stops the run).
    ``prompts``: the batch's prompts by ``prompt_index`` (for the report's prompt)."""
    failed = [g for g in gens if str(g.extra.get("end_reason") or "").split(":", 1)[0] in FAILURES]
    if not failed:
        return FailureCount(0, len(gens), None)
    first = failed[0]
    info = first.extra.get("failure") or {}
    prompt = None
    if prompts is not None and 0 <= first.prompt_index < len(prompts):
        prompt = getattr(prompts[first.prompt_index], "row", {}).get("prompt")
    report = (f"environment {info.get('env_class')!r} failed at turn {info.get('turn')} of a trajectory: "
              f"{first.extra['end_reason']}\n--- prompt ---\n{str(prompt)[:2000]}\n--- trajectory (model and "
              f"environment turns) ---\n{first.text[-3000:]}\n--- traceback ---\n{info.get('traceback', '')}")
    if len(failed) > max_ratio * len(gens):
        raise EnvironmentFailure(f"{len(failed)} of {len(gens)} trajectories ended by an environment fault, more than "
                                 f"environment.max_env_error_ratio={max_ratio} allows (raise it to train on without "
                                 f"them). The first: {report}")
    return FailureCount(len(failed), len(gens), report)
