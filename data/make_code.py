"""Generate the embedded code training set: small MBPP-style function problems with tests.

``python data/make_code.py`` rewrites ``data/code/train.jsonl``. Everything follows from one fixed seed, so
the file is reproducible.

Each row comes from a template (a FAMILY) instantiated with random parameters: the problem text names the
function and its signature, ``code`` is a reference solution written as a model would write it, and
``test_list`` holds three asserts whose expected values are computed here by an independent Python
implementation of the same template (``tests/test_code.py`` runs every reference solution against its
tests in the sandbox, so a template whose code and implementation disagree is caught)::

    {"task_id": "train_0007", "text": "Write a function count_char(s) that returns how many times ...",
     "code": "def count_char(s):\\n    return s.count('a')\\n",
     "test_list": ["assert count_char('banana') == 3", ...], "test_setup_code": ""}

The families are simple on purpose (arithmetic, strings, lists): the embedded model is tiny.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "code"
SPLIT_SIZES_AND_SEEDS = {"train": (200, 20240611)}
TESTS_PER_ROW = 3

WORDS = (
    "apple banana cherry delta echo forest garden harbor island jungle kettle lemon mango night ocean "
    "piano quartz river stone tiger umbrella violet window yellow zebra"
).split()


@dataclass(frozen=True)
class Problem:
    text: str
    code: str
    function: str  # the function's name, used in the asserts
    reference: Callable  # an independent implementation that computes the expected values
    inputs: list[tuple]  # argument tuples for the tests


def _ints(rng: random.Random, n: int, low: int = -20, high: int = 50) -> list[int]:
    return [rng.randint(low, high) for _ in range(n)]


def _word_list(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _sentence(rng: random.Random) -> str:
    return " ".join(_word_list(rng, rng.randint(2, 6)))


def _lists(rng: random.Random) -> list[tuple]:
    return [(_ints(rng, rng.randint(1, 7)),) for _ in range(TESTS_PER_ROW)]


def add_constant(rng: random.Random) -> Problem:
    k = rng.randint(2, 30)
    return Problem(
        f"Write a function add_constant(x) that returns the number x plus {k}.",
        f"def add_constant(x):\n    return x + {k}\n",
        "add_constant",
        lambda x: x + k,
        [(rng.randint(-100, 100),) for _ in range(TESTS_PER_ROW)],
    )


def multiply_by(rng: random.Random) -> Problem:
    k = rng.randint(2, 12)
    return Problem(
        f"Write a function multiply_by(x) that returns x multiplied by {k}.",
        f"def multiply_by(x):\n    return x * {k}\n",
        "multiply_by",
        lambda x: x * k,
        [(rng.randint(-50, 50),) for _ in range(TESTS_PER_ROW)],
    )


def is_divisible(rng: random.Random) -> Problem:
    k = rng.randint(2, 9)
    inputs = [
        (k * rng.randint(1, 20),),
        (k * rng.randint(1, 20) + rng.randint(1, k - 1),),
        (rng.randint(1, 200),),
    ]
    return Problem(
        f"Write a function is_divisible(n) that returns True if n is divisible by {k} and False otherwise.",
        f"def is_divisible(n):\n    return n % {k} == 0\n",
        "is_divisible",
        lambda n: n % k == 0,
        inputs,
    )


def count_char(rng: random.Random) -> Problem:
    c = rng.choice("aeiornst")
    return Problem(
        f"Write a function count_char(s) that returns how many times the letter {c!r} appears in the string s.",
        f"def count_char(s):\n    return s.count({c!r})\n",
        "count_char",
        lambda s: sum(1 for ch in s if ch == c),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def reverse_words(rng: random.Random) -> Problem:
    return Problem(
        "Write a function reverse_words(s) that returns the words of the string s in reverse order, "
        "separated by single spaces.",
        "def reverse_words(s):\n    return ' '.join(s.split()[::-1])\n",
        "reverse_words",
        lambda s: " ".join(reversed(s.split())),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def sum_of_multiples(rng: random.Random) -> Problem:
    k = rng.randint(2, 7)
    return Problem(
        f"Write a function sum_of_multiples(n) that returns the sum of the positive integers below n that are "
        f"multiples of {k}.",
        f"def sum_of_multiples(n):\n    return sum(i for i in range(1, n) if i % {k} == 0)\n",
        "sum_of_multiples",
        lambda n: sum(range(k, n, k)),
        [(rng.randint(1, 60),) for _ in range(TESTS_PER_ROW)],
    )


def clamp(rng: random.Random) -> Problem:
    low = rng.randint(-10, 10)
    high = low + rng.randint(5, 30)
    inputs = [(low - rng.randint(1, 20),), (high + rng.randint(1, 20),), (rng.randint(low, high),)]
    rng.shuffle(inputs)
    return Problem(
        f"Write a function clamp(x) that returns x limited to the range from {low} to {high} inclusive.",
        f"def clamp(x):\n    return max({low}, min({high}, x))\n",
        "clamp",
        lambda x: low if x < low else high if x > high else x,
        inputs,
    )


def value_range(rng: random.Random) -> Problem:
    return Problem(
        "Write a function value_range(nums) that returns the largest number in the non-empty list nums minus "
        "the smallest.",
        "def value_range(nums):\n    return max(nums) - min(nums)\n",
        "value_range",
        lambda nums: sorted(nums)[-1] - sorted(nums)[0],
        _lists(rng),
    )


def filter_greater(rng: random.Random) -> Problem:
    k = rng.randint(0, 30)
    return Problem(
        f"Write a function filter_greater(nums) that returns a list of the numbers in nums that are greater "
        f"than {k}, in their original order.",
        f"def filter_greater(nums):\n    return [x for x in nums if x > {k}]\n",
        "filter_greater",
        lambda nums: list(filter(lambda x: x > k, nums)),
        _lists(rng),
    )


def square_all(rng: random.Random) -> Problem:
    return Problem(
        "Write a function square_all(nums) that returns a list of the squares of the numbers in nums.",
        "def square_all(nums):\n    return [x * x for x in nums]\n",
        "square_all",
        lambda nums: [x**2 for x in nums],
        _lists(rng),
    )


def repeat_string(rng: random.Random) -> Problem:
    k = rng.randint(2, 4)
    return Problem(
        f"Write a function repeat_string(s) that returns the string s repeated {k} times.",
        f"def repeat_string(s):\n    return s * {k}\n",
        "repeat_string",
        lambda s: "".join([s] * k),
        [(rng.choice(WORDS)[: rng.randint(1, 5)],) for _ in range(TESTS_PER_ROW)],
    )


def first_evens(rng: random.Random) -> Problem:
    return Problem(
        "Write a function first_evens(n) that returns a list of the first n even numbers, starting at 0.",
        "def first_evens(n):\n    return [2 * i for i in range(n)]\n",
        "first_evens",
        lambda n: list(range(0, 2 * n, 2)),
        [(rng.randint(0, 8),) for _ in range(TESTS_PER_ROW)],
    )


def count_vowels(rng: random.Random) -> Problem:
    return Problem(
        "Write a function count_vowels(s) that returns the number of vowels (a, e, i, o, u) in the lowercase "
        "string s.",
        "def count_vowels(s):\n    return sum(1 for ch in s if ch in 'aeiou')\n",
        "count_vowels",
        lambda s: len([ch for ch in s if ch in set("aeiou")]),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def is_palindrome(rng: random.Random) -> Problem:
    def word() -> str:
        half = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
        return half + half[::-1] if rng.random() < 0.5 else half + rng.choice("xyz")

    return Problem(
        "Write a function is_palindrome(s) that returns True if the string s reads the same forwards and "
        "backwards, else False.",
        "def is_palindrome(s):\n    return s == s[::-1]\n",
        "is_palindrome",
        lambda s: all(s[i] == s[len(s) - 1 - i] for i in range(len(s))),
        [(word(),) for _ in range(TESTS_PER_ROW)],
    )


def fizz_label(rng: random.Random) -> Problem:
    k = rng.randint(3, 7)
    inputs = [(k * rng.randint(1, 10),), (k * rng.randint(1, 10) + 1,), (rng.randint(1, 100),)]
    return Problem(
        f"Write a function fizz_label(n) that returns the string 'Fizz' if n is divisible by {k}, and otherwise "
        f"n as a string.",
        f"def fizz_label(n):\n    if n % {k} == 0:\n        return 'Fizz'\n    return str(n)\n",
        "fizz_label",
        lambda n: "Fizz" if n % k == 0 else f"{n}",
        inputs,
    )


def digit_sum(rng: random.Random) -> Problem:
    return Problem(
        "Write a function digit_sum(n) that returns the sum of the decimal digits of the non-negative integer n.",
        "def digit_sum(n):\n    return sum(int(d) for d in str(n))\n",
        "digit_sum",
        lambda n: n % 10 + (0 if n < 10 else digit_sum_reference(n // 10)),
        [(rng.randint(0, 99999),) for _ in range(TESTS_PER_ROW)],
    )


def digit_sum_reference(n: int) -> int:
    total = 0
    while n:
        n, digit = divmod(n, 10)
        total += digit
    return total


def count_long_words(rng: random.Random) -> Problem:
    k = rng.randint(3, 6)
    return Problem(
        f"Write a function count_long_words(s) that returns how many words of the string s have more than {k} "
        f"letters.",
        f"def count_long_words(s):\n    return len([w for w in s.split() if len(w) > {k}])\n",
        "count_long_words",
        lambda s: sum(len(w) > k for w in s.split(" ")),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def running_total(rng: random.Random) -> Problem:
    def reference(nums: list[int]) -> list[int]:
        return [sum(nums[: i + 1]) for i in range(len(nums))]

    return Problem(
        "Write a function running_total(nums) that returns a list whose i-th element is the sum of the first "
        "i + 1 numbers of nums.",
        "def running_total(nums):\n    result = []\n    total = 0\n    for x in nums:\n        total += x\n"
        "        result.append(total)\n    return result\n",
        "running_total",
        reference,
        _lists(rng),
    )


def power_sum(rng: random.Random) -> Problem:
    k = rng.randint(2, 3)
    return Problem(
        f"Write a function power_sum(n) that returns 1**{k} + 2**{k} + ... + n**{k} (0 when n is 0).",
        f"def power_sum(n):\n    return sum(i ** {k} for i in range(1, n + 1))\n",
        "power_sum",
        lambda n: (n * (n + 1) // 2) ** 2 if k == 3 else n * (n + 1) * (2 * n + 1) // 6,
        [(rng.randint(0, 20),) for _ in range(TESTS_PER_ROW)],
    )


def replace_char(rng: random.Random) -> Problem:
    old, new = rng.sample("aeiou", 2)
    return Problem(
        f"Write a function replace_char(s) that returns the string s with every {old!r} replaced by {new!r}.",
        f"def replace_char(s):\n    return s.replace({old!r}, {new!r})\n",
        "replace_char",
        lambda s: "".join(new if ch == old else ch for ch in s),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def caesar_shift(rng: random.Random) -> Problem:
    k = rng.randint(1, 25)

    def reference(s: str) -> str:
        letters = string.ascii_lowercase
        return "".join(letters[(letters.index(ch) + k) % 26] for ch in s)

    return Problem(
        f"Write a function caesar_shift(s) that shifts every letter of the lowercase string s forward by {k} "
        f"places in the alphabet, wrapping around from 'z' to 'a'.",
        f"def caesar_shift(s):\n    return ''.join(chr((ord(c) - ord('a') + {k}) % 26 + ord('a')) for c in s)\n",
        "caesar_shift",
        reference,
        [(rng.choice(WORDS),) for _ in range(TESTS_PER_ROW)],
    )


def unique_in_order(rng: random.Random) -> Problem:
    def reference(nums: list[int]) -> list[int]:
        return list(dict.fromkeys(nums))

    return Problem(
        "Write a function unique_in_order(nums) that returns the numbers of nums without duplicates, keeping "
        "the first occurrence of each in its original order.",
        "def unique_in_order(nums):\n    seen = set()\n    result = []\n    for x in nums:\n"
        "        if x not in seen:\n            seen.add(x)\n            result.append(x)\n    return result\n",
        "unique_in_order",
        reference,
        [(_ints(rng, rng.randint(1, 8), 0, 5),) for _ in range(TESTS_PER_ROW)],
    )


def count_evens(rng: random.Random) -> Problem:
    return Problem(
        "Write a function count_evens(nums) that returns how many numbers in nums are even.",
        "def count_evens(nums):\n    return sum(1 for x in nums if x % 2 == 0)\n",
        "count_evens",
        lambda nums: len([x for x in nums if not x & 1]),
        _lists(rng),
    )


def capitalize_words(rng: random.Random) -> Problem:
    return Problem(
        "Write a function capitalize_words(s) that returns the string s with the first letter of every word "
        "in upper case (words are separated by single spaces).",
        "def capitalize_words(s):\n    return ' '.join(w[0].upper() + w[1:] for w in s.split(' '))\n",
        "capitalize_words",
        lambda s: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")),
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


def longest_word(rng: random.Random) -> Problem:
    def reference(s: str) -> str:
        best = ""
        for word in s.split():
            if len(word) > len(best):
                best = word
        return best

    return Problem(
        "Write a function longest_word(s) that returns the longest word of the string s (the first one if "
        "several are equally long).",
        "def longest_word(s):\n    return max(s.split(), key=len)\n",
        "longest_word",
        reference,
        [(_sentence(rng),) for _ in range(TESTS_PER_ROW)],
    )


FAMILIES: tuple[Callable[[random.Random], Problem], ...] = (
    add_constant, multiply_by, is_divisible, count_char, reverse_words, sum_of_multiples, clamp, value_range,
    filter_greater, square_all, repeat_string, first_evens, count_vowels, is_palindrome, fizz_label, digit_sum,
    count_long_words, running_total, power_sum, replace_char, caesar_shift, unique_in_order, count_evens,
    capitalize_words, longest_word,
)  # fmt: skip


def _call(function: str, args: tuple) -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


def make_row(index: int, problem: Problem, split: str) -> dict:
    tests = [
        f"assert {_call(problem.function, args)} == {problem.reference(*args)!r}" for args in problem.inputs
    ]
    return {
        "task_id": f"{split}_{index:04d}",
        "text": problem.text,
        "code": problem.code,
        "test_list": tests,
        "test_setup_code": "",
    }


def generate(n: int, seed: int, split: str = "train") -> list[dict]:
    """``n`` rows; the families cycle in a seeded random order so that every family appears about equally."""
    rng = random.Random(seed)
    rows = []
    order: list[Callable[[random.Random], Problem]] = []
    for index in range(n):
        if not order:
            order = list(FAMILIES)
            rng.shuffle(order)
        rows.append(make_row(index, order.pop()(rng), split))
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in generate(n, seed, split):
            f.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        print(f"wrote {write_split(args.out_dir, split, n, seed)} ({n} rows)")


if __name__ == "__main__":
    main()
