"""Multi-turn conversations with real chat templates, built as SkyRL's generator builds them
(:class:`mlora.rollout.multi_turn.TurnFormat`: SkyRL's fixed base conversation [system, user], observations cut
from it at the token level).

The templates are their owners' files, not retyped: SmolLM2-135M-Instruct's own (in its GGUF, the ``smollm2``
fixture), and Qwen3's, Qwen2.5's and Llama-3.1's as TRL ships them (``trl/chat_templates/``). A conversation
grown turn by turn (the prompt, the model's turn, the observations, the next turn) must be the tokens of the whole
conversation rendered at once, for ``use_conversation_multi_turn`` true; false appends the observations as text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATES = ("smollm2", "qwen3", "qwen2_5", "llama3_1")
# Llama-3's own special tokens (SmolLM2's tokenizer, which the test borrows, has ChatML's only)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    from transformers import AutoTokenizer

    out = {}
    for name in TEMPLATES:
        tok = AutoTokenizer.from_pretrained(str(smollm2))
        if name == "llama3_1":
            tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS, "eos_token": "<|eot_id|>"})
        if name != "smollm2":
            tok.chat_template = trl_template(name)
        out[name] = tok
    return out


QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
OBSERVATION = [{"role": "user", "content": "Not quite. Try again."}]


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_turn_by_turn_equals_the_whole_conversation(tokenizers, name):
    from mlora.rollout.data import prompt_ids
    from mlora.rollout.multi_turn import TurnFormat

    tok = tokenizers[name]
    fmt = TurnFormat(tok, conversation=True)
    assert fmt.chat and fmt.base_ids
    first, second = "It is 9.", "It is 19."
    ids = prompt_ids({"prompt": QUESTION}, tok)
    turn1 = _encode(tok, first) + [tok.eos_token_id]
    ids += turn1 + fmt.close_turn(turn1, first) + fmt.observation_ids(OBSERVATION)
    whole = QUESTION + [{"role": "assistant", "content": first}] + OBSERVATION + \
        [{"role": "assistant", "content": second}]
    rendered = list(tok.apply_chat_template(whole, tokenize=True, return_dict=False))
    if name == "llama3_1":
        # SmolLM2's BPE, borrowed for Llama-3's template, splits "\n\n" by what follows it: compare the text
        rendered_text = tok.decode(rendered)
        assert rendered_text.startswith(tok.decode(ids)), (tok.decode(ids), rendered_text)
        assert rendered_text.startswith(tok.decode(ids + _encode(tok, second) + [tok.eos_token_id]))
        return
    # up to the second turn's generation prompt: the whole rendering's tokens
    assert rendered[:len(ids)] == ids, (tok.decode(ids), tok.decode(rendered))
    ids += _encode(tok, second) + [tok.eos_token_id]
    if name == "qwen3":  # Qwen3's template writes an empty think block into the last assistant message itself
        assert tok.decode(rendered[len(ids) - len(_encode(tok, second)) - 1:]).startswith("<think>")
    else:  # the whole rendering may close the last turn with more than its EOS (ChatML's newline): a prefix
        assert rendered[:len(ids)] == ids, (tok.decode(ids), tok.decode(rendered))
        assert len(rendered) - len(ids) <= 2


@pytest.mark.parametrize("name", TEMPLATES)
def test_stop_strings_and_plain_text_observations(tokenizers, name):
    from mlora.rollout.multi_turn import TurnFormat

    tok = tokenizers[name]
    eos = tok.eos_token_id
    stopped = _encode(tok, "<answer>19</answer>")
    with_eos = TurnFormat(tok, conversation=True, stop=["</answer>"])
    assert with_eos.close_turn(stopped, "<answer>19</answer>") == [eos]  # SkyRL appends EOS after a stop string
    assert with_eos.close_turn(stopped + [eos], "<answer>19</answer>") == []
    assert with_eos.close_turn(stopped, "<answer>19") == []  # cut at the length limit: nothing appended
    without = TurnFormat(tok, conversation=True, stop=["</answer>"], append_eos_after_stop=False)
    assert without.close_turn(stopped, "<answer>19</answer>") == []
    plain = TurnFormat(tok, conversation=False)
    assert plain.open_turn(stopped + [eos]) == 1 and plain.close_turn(stopped, "x") == []
    assert plain.observation_ids(OBSERVATION) == _encode(tok, OBSERVATION[0]["content"])


def test_a_template_that_breaks_the_base_is_refused_at_start(tokenizers):
    """A template that renders the base conversation's start differently once more follows cannot give
    observation tokens: refused when the run starts, naming the keys, not counted against an environment."""
    from mlora.rollout.multi_turn import TurnFormat

    tok = tokenizers["smollm2"]
    original = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}{{ messages | length }}: {{ m['content'] }}\n{% endfor %}"
        with pytest.raises(ValueError, match="generator.use_conversation_multi_turn=false"):
            TurnFormat(tok, conversation=True)
    finally:
        tok.chat_template = original


def test_chat_template_keys_render_prompts(tokenizers, tmp_path):
    """generator.chat_template (a file, or SkyRL's named templates from the skyrl wheel) and chat_template_kwargs
    reach every rendering."""
    from transformers import AutoTokenizer

    from mlora.rollout.chat_template import apply_run_template, resolve_chat_template, skyrl_named_templates
    from mlora.rollout.data import prompt_ids

    path = tmp_path / "qwen3.jinja"
    path.write_text(trl_template("qwen3"))
    tok = apply_run_template(AutoTokenizer.from_pretrained(tokenizers["smollm2"].name_or_path),
                             resolve_chat_template("file", str(path)), {"enable_thinking": False})
    text = tok.decode(prompt_ids({"prompt": QUESTION}, tok))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), text  # Qwen3 with thinking off
    named = resolve_chat_template("name", "qwen3_without_thinking")
    assert named == skyrl_named_templates()["qwen3_without_thinking"] and "{% generation %}" in named
    assert resolve_chat_template("name", None) is None
