"""Prompt format, answer extraction, grading and the reward on real GSM8K / MATH-500 rows."""

import json
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from qerl_lib.config import RewardConfig
from qerl_lib.rewards import (
    MATH_INSTRUCTION,
    NUMERIC_INSTRUCTION,
    PromptStyle,
    RewardBreakdown,
    build_messages,
    effective_grader,
    extract_answer,
    format_prompt,
    has_format,
    is_correct,
    last_boxed,
    normalize_number,
    overlong_penalty,
    prompt_style,
    resolve_grader,
    score,
    to_fraction,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")


def _jsonl(rel: str, n: int) -> list[dict]:
    path = DATA / rel
    if not path.is_file():
        pytest.skip(f"real data not present: {path}")
    with path.open() as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


@pytest.fixture(scope="module")
def gsm8k_rows():
    return _jsonl("gsm8k/test.jsonl", 300)


@pytest.fixture(scope="module")
def math500_rows():
    return _jsonl("math500/test.jsonl", 500)


def _truth(answer: str) -> str:
    return normalize_number(answer.rsplit("####", 1)[1])


def _perturbed_solution(answer: str) -> str:
    head, tail = answer.rsplit("####", 1)
    return f"{head}#### {to_fraction(tail) + 1}"


# --- GSM8K ------------------------------------------------------------------------


def test_gsm8k_reference_solutions_score_one_strict(gsm8k_rows):
    cfg = RewardConfig(lenient_extraction=False, format_weight=0.1)
    for row in gsm8k_rows:
        truth = _truth(row["answer"])
        r = score(row["answer"], truth, "gsm8k", n_tokens=100, max_new_tokens=512, truncated=False, cfg=cfg)
        assert r.correct and r.format, (row["answer"][-40:], truth, r)
        assert r.total == pytest.approx(1.1)


def test_gsm8k_perturbed_answers_score_zero(gsm8k_rows):
    cfg = RewardConfig(lenient_extraction=False, format_weight=0.1)
    for row in gsm8k_rows:
        truth = _truth(row["answer"])
        wrong = _perturbed_solution(row["answer"])
        r = score(wrong, truth, "gsm8k", n_tokens=100, max_new_tokens=512, truncated=False, cfg=cfg)
        assert not r.correct, (wrong[-40:], truth)
        assert r.format and r.total == pytest.approx(0.1)


def test_gsm8k_thousands_separators_in_real_rows(gsm8k_rows):
    with_commas = [row for row in gsm8k_rows if "," in row["answer"].rsplit("####", 1)[1]]
    assert with_commas, "GSM8K test holds answers like '#### 2,125' (SOURCES.md)"
    for row in with_commas:
        raw = row["answer"].rsplit("####", 1)[1].strip()
        assert "," not in _truth(row["answer"])
        assert is_correct(raw.replace(",", ""), raw, "gsm8k")


def test_gsm8k_boxed_and_decorated_answers():
    cases = {
        "so she makes 9 * 2 = $18.\n#### 18": "18",
        "#### $1,000.": "1000",
        "#### **42**": "42",
        "####18 dollars": "18",
        "#### -3": "-3",
        "#### 12.0": "12",
        "#### 0.50": "0.5",
        "first #### 3 then #### 4": "4",
        "The answer is \\boxed{18}.": "18",
        "The answer is $\\boxed{\\$1,234}$": "1234",
        "\\boxed{\\frac{1}{2}}": "0.5",
        "\\boxed{18 \\text{ apples}}": "18",
    }
    for text, want in cases.items():
        assert extract_answer(text, "gsm8k", lenient=False) == want, text


def test_lenient_vs_strict():
    text = "First 7 + 5 = 12, then 12 - 3 = 9."
    assert extract_answer(text, "gsm8k", lenient=False) is None
    assert extract_answer(text, "gsm8k", lenient=True) == "9"
    # a marker always wins over the last number
    assert extract_answer("#### 12\nBut 7 + 5 = 13", "gsm8k", lenient=True) == "12"
    # "10-3" is 10 minus 3, not a negative 3
    assert extract_answer("10-3", "gsm8k", lenient=True) == "3"
    assert extract_answer("it is -3.", "gsm8k", lenient=True) == "-3"
    assert extract_answer("no numbers here", "gsm8k", lenient=True) is None
    strict, lenient = RewardConfig(lenient_extraction=False), RewardConfig()
    kw = dict(n_tokens=10, max_new_tokens=48, truncated=False)
    assert score(text, "9", "arith", cfg=strict, **kw).total == 0.0
    assert score(text, "9", "arith", cfg=lenient, **kw) == RewardBreakdown(True, False, 0.0, 1.0, "9")


def test_numeric_equality_is_exact_not_float():
    assert is_correct("12.0", "12", "gsm8k")
    assert is_correct("1,200", "1200", "gsm8k")
    assert is_correct("0.5", "1/2", "gsm8k")
    assert not is_correct("0.30000000000000004", "0.3", "gsm8k")
    assert not is_correct("12.01", "12", "gsm8k")
    assert not is_correct(None, "12", "gsm8k")
    assert not is_correct("", "12", "gsm8k")
    assert to_fraction("3, 5, 7") is None  # a list is not a number
    assert to_fraction("52_8") is None  # Decimal would read 528
    assert to_fraction("1e3") is None
    assert to_fraction("\\frac{-3}{4}") == Fraction(-3, 4)
    assert normalize_number("1/3") == "1/3" and normalize_number("-0.250") == "-0.25"


# --- MATH-500 ---------------------------------------------------------------------


def _equivalent_forms(answer: str) -> list[str]:
    """Ways of writing the same answer that differ from the reference text."""
    forms = []
    value = to_fraction(answer)
    if value is not None:
        forms.append(f"{value.numerator}.0" if value.denominator == 1 else f"{value.numerator}/{value.denominator}")
    if " " in answer:
        forms.append(answer.replace(" ", ""))
    if "\\left" in answer:
        forms.append(answer.replace("\\left", "").replace("\\right", ""))
    if "\\dfrac" in answer:
        forms.append(answer.replace("\\dfrac", "\\frac"))
    return forms


def test_math500_reference_solutions_extract_and_verify(math500_rows):
    for row in math500_rows:
        extracted = extract_answer(row["solution"], "math")
        assert extracted is not None and is_correct(extracted, row["answer"], "math"), row["unique_id"]


def test_math500_equivalent_forms_score_one(math500_rows):
    cfg = RewardConfig(lenient_extraction=False)
    checked = 0
    for row in math500_rows[:250]:
        for form in _equivalent_forms(row["answer"]):
            assert form != row["answer"]
            text = f"So the answer is $\\boxed{{{form}}}$."
            r = score(text, row["answer"], "math", n_tokens=50, max_new_tokens=512, truncated=False, cfg=cfg)
            assert r.correct and r.format, (row["unique_id"], form, row["answer"])
            checked += 1
    assert checked > 150  # the forms above really exercise math-verify, not string equality


def test_math500_perturbed_numeric_answers_score_zero(math500_rows):
    numeric = [row for row in math500_rows if to_fraction(row["answer"]) is not None]
    assert len(numeric) > 300
    for row in numeric:
        wrong = to_fraction(row["answer"]) + 1
        wrong_tex = str(wrong) if wrong.denominator == 1 else f"\\frac{{{wrong.numerator}}}{{{wrong.denominator}}}"
        assert not is_correct(extract_answer(f"\\boxed{{{wrong_tex}}}", "math"), row["answer"], "math"), row["answer"]


def test_math_symbolic_equivalence_and_difference():
    assert is_correct("\\frac{\\pi}{2}", "\\dfrac{\\pi}{2}", "math")
    assert is_correct("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", "math")
    assert is_correct("2\\sqrt{2}", "\\sqrt{8}", "math")
    assert not is_correct("\\sqrt{3}", "\\sqrt{2}", "math")
    assert not is_correct("x+1", "x+2", "math")


def test_math_grading_works_off_the_main_thread():
    # math-verify's signal-based timeout raises outside the main thread; the grader
    # switches it off there, so thread pools still get real answers.
    results = []
    t = threading.Thread(target=lambda: results.append(
        (is_correct("\\frac{1}{2}", "0.5", "math"), is_correct("\\frac{1}{3}", "0.5", "math"))))  # fmt: skip
    t.start()
    t.join()
    assert results == [(True, False)]


def test_last_boxed_balanced_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}} c") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{unclosed {") is None
    assert last_boxed("nothing") is None
    assert extract_answer("the answer is 5", "math", lenient=False) is None
    assert extract_answer("the answer is 5", "math", lenient=True) == "5"


# --- format and overlong -----------------------------------------------------------


def test_has_format():
    assert has_format("2 + 3 = 5\n#### 5", "gsm8k")
    assert has_format("\\boxed{5}", "gsm8k")
    assert not has_format("#### five", "gsm8k")
    assert not has_format("the answer is 5", "gsm8k")
    assert not has_format("\\boxed{}", "gsm8k")
    assert has_format("\\boxed{x^2}", "math")
    assert not has_format("#### 5", "math")


def test_format_reward_is_paid_for_wrong_answers():
    cfg = RewardConfig(format_weight=0.1)
    r = score("2 + 3 = 6\n#### 6", "5", "arith", n_tokens=8, max_new_tokens=48, truncated=False, cfg=cfg)
    assert (r.correct, r.format, r.total, r.extracted) == (False, True, pytest.approx(0.1), "6")
    r = score("#### 5", "5", "arith", n_tokens=8, max_new_tokens=48, truncated=False,
              cfg=RewardConfig(correct_weight=2.0, format_weight=0.5))  # fmt: skip
    assert r.total == pytest.approx(2.5)


@pytest.mark.parametrize(
    "n_tokens, truncated, expected",
    [(10, False, 0.0), (32, False, 0.0), (36, False, -0.25), (40, False, -0.5), (47, False, -0.9375),
     (48, False, -1.0), (48, True, -1.0), (20, True, -1.0)],
)  # fmt: skip
def test_overlong_penalty_values(n_tokens, truncated, expected):
    # max 48, buffer 16: free up to 32 tokens, then linear down to -penalty at 48
    assert overlong_penalty(n_tokens, 48, truncated, buffer=16, penalty=1.0) == pytest.approx(expected)


def test_overlong_penalty_in_score_and_off_by_default():
    kw = dict(n_tokens=40, max_new_tokens=48, truncated=False)
    on = RewardConfig(overlong_buffer=16, overlong_penalty=0.5, format_weight=0.1)
    r = score("#### 5", "5", "arith", cfg=on, **kw)
    assert r.overlong == pytest.approx(-0.25) and r.total == pytest.approx(1.1 - 0.25)
    r = score("#### 5", "5", "arith", cfg=RewardConfig(format_weight=0.1), n_tokens=48, max_new_tokens=48, truncated=True)
    assert r.overlong == 0.0 and r.total == pytest.approx(1.1)


# --- prompt ---------------------------------------------------------------------------


class _ChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


class _PlainTok:
    chat_template = None


def test_prompt_format():
    msgs = build_messages("What is 7 + 5?", "arith")
    assert msgs[-1]["role"] == "user" and "What is 7 + 5?" in msgs[-1]["content"]
    assert "####" in msgs[-1]["content"]
    math_msg = build_messages("Find $x$ if $\\{x\\} = 1$.", "math")[-1]["content"]
    assert "\\boxed{}" in math_msg and "Find $x$ if $\\{x\\} = 1$." in math_msg
    chat = format_prompt(_ChatTok(), "What is 7 + 5?", "gsm8k")
    assert chat.startswith("<") and chat.endswith("<assistant>") and "What is 7 + 5?" in chat
    plain = format_prompt(_ChatTok(), "What is 7 + 5?", "gsm8k", chat_template=False)
    assert plain == format_prompt(_PlainTok(), "What is 7 + 5?", "gsm8k")
    assert plain.endswith(msgs[-1]["content"] + "\n") and "<user>" not in plain
    assert "{question}" in NUMERIC_INSTRUCTION and "{question}" in MATH_INSTRUCTION
    with pytest.raises(ValueError, match="question"):
        build_messages("q", "arith", style=PromptStyle("no slot"))


def test_prompt_style_examples_and_system():
    style = PromptStyle("Q: {question}", examples=(("What is 1 + 1?", "#### 2"),), system="be brief")
    msgs = build_messages(" What is 3 + 4? ", "arith", style=style)
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Q: What is 1 + 1?"},
        {"role": "assistant", "content": "#### 2"},
        {"role": "user", "content": "Q: What is 3 + 4?"},
    ]
    assert format_prompt(_PlainTok(), "What is 3 + 4?", "arith", style=style) == (
        "be brief\n\nQ: What is 1 + 1?\n\n#### 2\n\nQ: What is 3 + 4?\n"
    )
    assert prompt_style("arith") is prompt_style("gsm8k") and prompt_style("math") is not prompt_style("gsm8k")


def test_resolve_grader():
    assert resolve_grader("arith") == resolve_grader("gsm8k") == "gsm8k"
    assert resolve_grader("math") == "math"
    with pytest.raises(ValueError, match="auto"):
        resolve_grader("auto")
    assert effective_grader("auto", "math") == "math"
    assert effective_grader("gsm8k", "math") == "gsm8k"


def test_row_style_picks_stepwise_for_word_problems_and_the_worked_example_for_synthetic_sums():
    from qerl_lib.rewards import MATH_STYLE, NUMERIC_STYLE, STEPWISE_STYLE, row_style

    assert row_style("auto", "gsm8k", synthetic=True) is NUMERIC_STYLE
    assert row_style("auto", "gsm8k", synthetic=False) is STEPWISE_STYLE
    assert row_style("auto", "math", synthetic=False) is MATH_STYLE
    assert row_style("worked_example", "gsm8k", synthetic=False) is NUMERIC_STYLE
    assert row_style("stepwise", "gsm8k", synthetic=True) is STEPWISE_STYLE
    msgs = build_messages("Tom has 5 apples.", "gsm8k", style=STEPWISE_STYLE)
    assert len(msgs) == 1 and "step by step" in msgs[0]["content"] and "#### <number>" in msgs[0]["content"]
