"""The one shared component for prompt format, answer extraction and grading.

Rollout, training (reward stage) and evaluation all import this module, so the prompt
a model sees and the rule that grades its answer can never drift apart between them.

Two graders:

- `gsm8k` (also used for the synthetic `arith` set): the final answer is the number
  after the last `####`, else the number in the last `\\boxed{}`; with lenient
  extraction, else the last number anywhere in the text. Numbers are compared exactly
  as fractions (`12`, `12.0`, `$12.` and `12.00` are equal).
- `math`: the final answer is the content of the last `\\boxed{...}` (balanced braces);
  equivalence is decided by `math-verify` (`parse` + `verify`).

All functions are pure; nothing here loads a model.
"""

from __future__ import annotations

import re
import threading
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Literal

from qerl_lib.config import RewardConfig

Grader = Literal["gsm8k", "math"]

# ---------------------------------------------------------------------------------
# Prompt format
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptStyle:
    """How a problem is put to the model.

    `instruction` is the user message template (`{question}` is the slot; `{{` / `}}`
    are literal braces). `examples` are worked (question, answer) pairs shown before the
    problem as earlier chat turns (user: the filled template, assistant: the answer):
    small instruct models copy a demonstrated format far more reliably than they follow
    a described one. `system` replaces the chat template's default system prompt when set.
    """

    instruction: str
    examples: tuple[tuple[str, str], ...] = ()
    system: str | None = None


NUMERIC_STYLE = PromptStyle(
    instruction="{question}\nGive the final answer on the last line in the form #### <number>.",
    examples=(
        (
            "Kim has 3 pears and gets 4 more. How many pears does Kim have now?",
            "Kim has 3 + 4 = 7 pears.\n#### 7",
        ),
    ),
)
"""Prompt of numeric tasks (gsm8k, synthetic arith): the question, then the `#### N`
instruction, after one worked word problem shown as an earlier chat exchange (its
name and object never occur in the synthetic set, so no generated question repeats it).

Chosen with benchmarks/baseline_task.py on SmolLM2-135M-Instruct (synthetic levels 1-2,
temperature 1.0; benchmarks/results/baseline_task.json): against the bare instruction,
the worked exchange lifts sampled accuracy from 0.11 to 0.29 (one-digit sums 0.21 to
0.53), the `####` rate from 0.06 to 0.74, and makes the model stop after the answer.
The same example written inside the user message was worse than none: the model
solved the example instead of the question. A second example showing subtraction made
it subtract in "gets more" problems."""

MATH_STYLE = PromptStyle(
    instruction="{question}\nReason step by step, then put the final answer in \\boxed{{}}.",
    examples=(
        (
            "What is $\\frac{1}{2} + \\frac{1}{4}$?",
            "$\\frac{1}{2} + \\frac{1}{4} = \\frac{2}{4} + \\frac{1}{4} = \\frac{3}{4}$, "
            "so the answer is $\\boxed{\\frac{3}{4}}$.",
        ),
    ),
)
"""Prompt of MATH-style tasks: the same shape as `NUMERIC_STYLE`, with a `\\boxed{}` answer."""

STEPWISE_STYLE = PromptStyle(
    instruction="{question}\nSolve it step by step, then give the final answer on the last line in the form "
                "#### <number>.",
)
"""Prompt of word problems (GSM8K and other non-synthetic numeric sets): the question and a
step-by-step instruction, no worked example.

Chosen with benchmarks/qwen_base_gsm8k.py on Qwen2.5-Coder-0.5B-Instruct: with
`NUMERIC_STYLE`'s one-line worked exchange the model copies its shape and answers
`#### N` without any working (0 of 20 test problems right,
benchmarks/results/qwen05_base_gsm8k_cpu.json); asked to reason step by step it does, and
answers in `#### N` or `\\boxed{}` (the grader takes both)."""

NUMERIC_INSTRUCTION = NUMERIC_STYLE.instruction
MATH_INSTRUCTION = MATH_STYLE.instruction
_STYLES = {"gsm8k": NUMERIC_STYLE, "math": MATH_STYLE}
PROMPT_STYLES = {"worked_example": NUMERIC_STYLE, "stepwise": STEPWISE_STYLE, "math": MATH_STYLE}
"""The prompt styles `data.prompt` names."""


def resolve_grader(layout_or_grader: str) -> Grader:
    """Map a dataset layout or grader name to the grader that scores it.

    `gsm8k` and `arith` grade numerically (`gsm8k`); `math` uses math-verify. `auto` is
    not accepted here: resolve it from the prepared data's `grader` column first.
    """
    key = str(layout_or_grader).strip().lower()
    if key in ("gsm8k", "arith"):
        return "gsm8k"
    if key == "math":
        return "math"
    raise ValueError(f"unknown grader or layout {layout_or_grader!r}: expected gsm8k, arith or math")


def effective_grader(config_grader: str, row_grader: str) -> Grader:
    """The grader for one prepared row: `RewardConfig.grader` unless it is `auto`, in
    which case the row's own `grader` column (set by `prepare` from the layout)."""
    return resolve_grader(row_grader if config_grader == "auto" else config_grader)


def prompt_style(grader: str) -> PromptStyle:
    """The default prompt style of a grader (or layout)."""
    return _STYLES[resolve_grader(grader)]


def row_style(prompt: str, grader: str, synthetic: bool) -> PromptStyle:
    """The prompt style of one prepared row under `data.prompt`.

    `auto`: `MATH_STYLE` for math-graded rows; `NUMERIC_STYLE` (one worked one-line
    exchange) for the synthetic arithmetic set (`synthetic`: the row has a `level`), where
    the answer is one sum; `STEPWISE_STYLE` for other numeric word problems (GSM8K),
    where a one-line example makes instruct models skip the reasoning. Any other value
    names a style of `PROMPT_STYLES` for every row.
    """
    if prompt != "auto":
        return PROMPT_STYLES[prompt]
    if resolve_grader(grader) == "math":
        return MATH_STYLE
    return NUMERIC_STYLE if synthetic else STEPWISE_STYLE


def format_row(tokenizer, row: dict, prompt: str, chat_template: bool = True) -> str:
    """The prompt text of one prepared row (`question`, `grader`, `level`) under `data.prompt`
    (`row_style`): what the rollout and eval stages feed the model and the preflight measures."""
    style = row_style(prompt, row["grader"], row.get("level") is not None)
    return format_prompt(tokenizer, row["question"], row["grader"], chat_template, style=style)


def _fill(template: str, question: str) -> str:
    # str.format would choke on the braces of `\boxed{}` inside questions; only the
    # `{question}` slot and the escaped `{{` / `}}` pairs are template syntax.
    head, sep, tail = template.partition("{question}")
    head = head.replace("{{", "{").replace("}}", "}")
    tail = tail.replace("{{", "{").replace("}}", "}")
    return head + (question if sep else "") + tail


def build_messages(question: str, grader: str, style: PromptStyle | None = None) -> list[dict]:
    """Chat messages for one problem: [system], then per worked example a user and an
    assistant turn, then the user turn holding the filled instruction.

    `style` overrides the grader's default (`prompt_style(grader)`); benchmarks use it to
    compare wordings. Without `style.system` no system message is added, so the chat
    template supplies its own default (SmolLM2's does).
    """
    style = style if style is not None else prompt_style(grader)
    if "{question}" not in style.instruction:
        raise ValueError("instruction template must contain '{question}'")
    messages = [{"role": "system", "content": style.system}] if style.system else []
    for q, a in style.examples:
        messages += [{"role": "user", "content": _fill(style.instruction, q)}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": _fill(style.instruction, question.strip())})
    return messages


def format_prompt(
    tokenizer, question: str, grader: str, chat_template: bool = True, style: PromptStyle | None = None
) -> str:
    """The exact prompt text fed to the model.

    With `chat_template` and a tokenizer that has one: the chat template applied to
    `build_messages` with `add_generation_prompt=True`. Otherwise plain text: the
    messages' contents separated by blank lines, ending in a newline, so a base model
    continues with the answer.
    """
    messages = build_messages(question, grader, style)
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n"


# ---------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------

# A number: thousands-separated (1,234,567.5), plain (-12, 3.5) or a bare decimal (.5).
# The minus sign counts only when not glued to a preceding digit or closing bracket, so
# "10-3" yields 10 and 3, not 10 and -3.
_NUM = r"(?:(?<![\d)\]])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUM_RE = re.compile(_NUM)
# `#### 18`, `####$1,000`, `#### **18**`, `#### : 18`: skip markdown, currency and colons.
_HASH_RE = re.compile(r"####[\s*:$\\]*(" + _NUM + r")")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
# What a whole string may be to count as one number: thousands separators only in
# groups of three (so "3, 5, 7" or "-2,1" are not numbers), no underscores or exponents
# (Decimal would accept "52_8" and "1e3").
_STRICT_NUM_RE = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$|^-?\.\d+$")
_RATIO_RE = re.compile(r"^(-?\d+)/(-?\d+)$")


def to_fraction(text: str) -> Fraction | None:
    """Exact value of a string that is one number (`"1,234"`, `"-3"`, `"12.50"`, `"$5."`,
    `"3/4"`, `"\\frac{3}{4}"`, `"10{,}000"`); None for anything else (`"3, 5, 7"`, `"3 5"`)."""
    s = text.strip().replace("\\$", "$").strip("$").strip()
    s = s.replace("{,}", ",").replace("\\,", ",").replace("\\!", "")  # LaTeX thousands separators
    s = re.sub(r"^-\s+", "-", s)
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]  # a sentence's full stop
    try:
        if m := _FRAC_RE.match(s):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if m := _RATIO_RE.match(s):
            return Fraction(int(m.group(1)), int(m.group(2)))
        if _STRICT_NUM_RE.match(s):
            return Fraction(Decimal(s.replace(",", "")))
    except (ValueError, ZeroDivisionError, InvalidOperation):
        return None
    return None


def normalize_number(text: str) -> str | None:
    """Canonical string of a number: `"12.0"` -> `"12"`, `"1,000"` -> `"1000"`,
    `"0.50"` -> `"0.5"`, `"-3"` -> `"-3"`, `"1/3"` -> `"1/3"`; None if not a number."""
    value = to_fraction(text)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # a terminating decimal
        out = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
        return out.rstrip("0").rstrip(".") if "." in out else out
    return f"{value.numerator}/{value.denominator}"


# ---------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, or of a
    brace-less `\\boxed 5`; None when there is none or its braces never close."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        m = re.match(r"\s+([^\s$]+)", rest)  # `\boxed 5`
        return m.group(1) if m else None
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
    return None


def _number_in(fragment: str) -> str | None:
    """The number a short answer fragment states (`"$1,000"`, `"\\frac{1}{2}"`, `"18 apples"`)."""
    whole = normalize_number(fragment)
    if whole is not None:
        return whole
    cleaned = re.sub(r"\\text\{[^}]*\}|\\(?:mathrm|mbox)\{[^}]*\}", " ", fragment)
    found = _NUM_RE.findall(cleaned)
    return normalize_number(found[-1]) if found else None


def extract_answer(text: str, grader: str, lenient: bool = False) -> str | None:
    """The final answer a completion states, or None.

    gsm8k: the number after the last `####`, else the number in the last `\\boxed{}`;
    with `lenient`, else the last number anywhere in the text. Returned normalised
    (commas, `$` and a trailing period stripped; `"12.0"` -> `"12"`).
    math: the content of the last `\\boxed{...}`; with `lenient`, else the text after a
    last `####`, else the last number. Returned as written (math-verify compares it).
    """
    grader = resolve_grader(grader)
    if grader == "gsm8k":
        hashes = _HASH_RE.findall(text)
        if hashes:
            return normalize_number(hashes[-1])
        boxed = last_boxed(text)
        if boxed is not None:
            number = _number_in(boxed)
            if number is not None:
                return number
        if lenient:
            found = _NUM_RE.findall(text)
            return normalize_number(found[-1]) if found else None
        return None
    boxed = last_boxed(text)
    if boxed:
        return boxed
    if lenient:
        hashes = _HASH_RE.findall(text)
        if hashes:
            return hashes[-1].strip()
        found = _NUM_RE.findall(text)
        return found[-1].replace(" ", "") if found else None
    return None


def has_format(text: str, grader: str) -> bool:
    """Whether the completion marks a final answer: gsm8k accepts a `#### N` (N a number)
    or a non-empty `\\boxed{}`; math accepts a non-empty `\\boxed{}` only."""
    if resolve_grader(grader) == "gsm8k" and _HASH_RE.search(text):
        return True
    return bool(last_boxed(text))


# ---------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------


def _math_verify(extracted: str, ground_truth: str) -> bool:
    """math-verify equivalence of two LaTeX answers.

    math-verify bounds parse/verify time with `signal.alarm`, which only works in the
    main thread (elsewhere it raises). Off the main thread (thread pools, Prefect task
    runners) the timeouts are switched off, as math-verify's own message advises.
    """
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
        pred = parse(f"\\boxed{{{extracted}}}", parsing_timeout=timeout)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a grader must never crash a training step
        return False


def is_correct(extracted: str | None, ground_truth: str, grader: str) -> bool:
    """Whether an extracted answer equals the ground truth under the grader's rule.

    gsm8k: exact numeric equality as fractions (`"12"` == `"12.0"`, `"1,200"` ==
    `"1200"`, `"0.5"` == `"1/2"`; never a float or string compare). math: identical
    strings, else math-verify `verify(gold, pred)`.
    """
    if extracted is None or not str(extracted).strip():
        return False
    if resolve_grader(grader) == "gsm8k":
        pred, gold = to_fraction(str(extracted)), to_fraction(str(ground_truth))
        return pred is not None and gold is not None and pred == gold
    gold_text, pred_text = str(ground_truth).strip(), str(extracted).strip()
    if gold_text == pred_text:
        return True
    return _math_verify(pred_text, gold_text)


# ---------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardBreakdown:
    """One completion's reward and its parts; `total = correct_weight * correct +
    format_weight * format + overlong` (`overlong` is the signed penalty, <= 0)."""

    correct: bool
    format: bool
    overlong: float
    total: float
    extracted: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def overlong_penalty(n_tokens: int, max_new_tokens: int, truncated: bool, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment (<= 0).

    Zero up to `max_new_tokens - buffer` tokens; over the last `buffer` tokens it falls
    linearly, reaching `-penalty` at `max_new_tokens`; a truncated completion (cut by the
    length cap) gets the full `-penalty`. `buffer == 0` turns it off.
    """
    if buffer <= 0 or penalty == 0:
        return 0.0
    if truncated or n_tokens >= max_new_tokens:
        return -float(penalty)
    start = max_new_tokens - buffer
    if n_tokens <= start:
        return 0.0
    return -float(penalty) * (n_tokens - start) / buffer


def score(
    completion_text: str,
    ground_truth: str,
    grader: str,
    *,
    n_tokens: int,
    max_new_tokens: int,
    truncated: bool,
    cfg: RewardConfig,
) -> RewardBreakdown:
    """Grade one completion and combine its reward parts (see `RewardBreakdown`)."""
    grader = resolve_grader(grader)
    extracted = extract_answer(completion_text, grader, lenient=cfg.lenient_extraction)
    correct = is_correct(extracted, ground_truth, grader)
    fmt = has_format(completion_text, grader)
    over = overlong_penalty(n_tokens, max_new_tokens, truncated, cfg.overlong_buffer, cfg.overlong_penalty)
    total = cfg.correct_weight * float(correct) + cfg.format_weight * float(fmt) + over
    return RewardBreakdown(correct=correct, format=fmt, overlong=over, total=total, extracted=extracted)
