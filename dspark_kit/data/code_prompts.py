"""The kit's Python prompts (`data.source: builtin:code`): code tasks for a real instruct model,
generated here, so a draft meant to serve code (HumanEval-style prompts) trains on code the
verifier writes, with no hub.

`builtin:instructions` asks for a Python function in 2 of its 26 task types over 14 tasks: 28
distinct prompts, so a draft trained on it sees little code, and its acceptance on HumanEval's
prompts stayed at 1.34 while held-out instructions reached 1.76 (SmolLM2-135M-Instruct,
docs/CONCEPTS.md). This set is all code, in four shapes:

- a function stub to complete (a signature, a docstring, doctest examples), the shape of
  HumanEval's prompts, written here: none of HumanEval's 164 functions is among them;
- "write a Python function that ...", with a spec's description;
- "explain this function", over a reference implementation;
- "write a test for this function".

Every example in a docstring is computed by the spec's own implementation, so no prompt teaches a
wrong answer. Rows are user turns only: regen writes the verifier's own replies (on-policy).
`code_conversations(n, seed)` draws them from `seed`, each prompt once. The draw is stable: the
first n rows of a longer draw are the n rows of a shorter one, so a regen of more rows resumes the
earlier one.

Layer 1 (data/): imports nothing of the kit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

CODE = "builtin:code"
TRAIN_SEED = 0

WORDS = ("apple", "banana", "level", "racecar", "python", "stream", "noon", "orange", "kayak", "window",
         "planet", "river", "civic", "garden", "rotor", "silver", "tomato", "bridge", "madam", "pencil")
SENTENCES = ("the quick brown fox jumps over the lazy dog", "hello world", "to be or not to be",
             "a stitch in time saves nine", "the cat sat on the mat", "practice makes perfect",
             "all that glitters is not gold", "every cloud has a silver lining")


def _ints(r: random.Random, lo: int = -9, hi: int = 20, n: tuple[int, int] = (3, 7)) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(*n))]


@dataclass(frozen=True)
class Spec:
    """One function: its name, parameters (name: type), return type, what it does (a sentence
    that fits "Return ..." in a docstring and "... that returns ..." in a request), its reference
    implementation (the source explained and tested) and a draw of example arguments."""

    name: str
    params: str
    returns: str
    does: str
    body: str  # the implementation's body, indented four spaces
    args: Callable[[random.Random], tuple]

    @cached_property
    def function(self) -> Callable:
        """The implementation, compiled once from source(): the source is what prompts show."""
        scope: dict = {}
        exec(self.source(), scope)  # noqa: S102 - the kit's own literal source in SPECS, never user input
        return scope[self.name]

    def call(self, *args):
        return self.function(*args)

    def source(self) -> str:
        return f"def {self.name}({self.params}) -> {self.returns}:\n{self.body}\n"


SPECS = (
    Spec("sum_of_evens", "numbers: list[int]", "int", "the sum of the even numbers in the list",
         "    return sum(n for n in numbers if n % 2 == 0)", lambda r: (_ints(r),)),
    Spec("count_vowels", "text: str", "int", "how many vowels (a, e, i, o, u) the text contains",
         "    return sum(1 for c in text.lower() if c in 'aeiou')", lambda r: (r.choice(SENTENCES),)),
    Spec("palindrome_word", "word: str", "bool", "True when the word reads the same backwards",
         "    return word == word[::-1]", lambda r: (r.choice(WORDS),)),
    Spec("second_largest", "numbers: list[int]", "int", "the second largest distinct number in the list",
         "    return sorted(set(numbers))[-2]", lambda r: (list(dict.fromkeys(_ints(r, 0, 50, (4, 7)))) + [51, 52],)),
    Spec("running_total", "numbers: list[int]", "list[int]", "the running totals of the list",
         "    out, total = [], 0\n    for n in numbers:\n        total += n\n        out.append(total)\n    return out",
         lambda r: (_ints(r, 0, 9),)),
    Spec("capitalize_words", "sentence: str", "str", "the sentence with every word capitalized",
         "    return ' '.join(w.capitalize() for w in sentence.split())", lambda r: (r.choice(SENTENCES),)),
    Spec("count_words", "sentence: str", "dict[str, int]", "how often each word appears in the sentence",
         "    counts = {}\n    for w in sentence.split():\n        counts[w] = counts.get(w, 0) + 1\n    return counts",
         lambda r: (r.choice(SENTENCES),)),
    Spec("digit_sum", "n: int", "int", "the sum of the digits of a non-negative integer",
         "    return sum(int(d) for d in str(n))", lambda r: (r.randint(0, 99999),)),
    Spec("prime_test", "n: int", "bool", "True when n is a prime number",
         "    if n < 2:\n        return False\n    return all(n % d for d in range(2, int(n ** 0.5) + 1))",
         lambda r: (r.randint(0, 60),)),
    Spec("gcd", "a: int, b: int", "int", "the greatest common divisor of two positive integers",
         "    while b:\n        a, b = b, a % b\n    return a", lambda r: (r.randint(1, 90), r.randint(1, 90))),
    Spec("fizzbuzz", "n: int", "list[str]", "the FizzBuzz strings for the numbers 1 to n",
         "    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
         "        out.append(s or str(i))\n    return out", lambda r: (r.randint(1, 16),)),
    Spec("unique_in_order", "items: list[int]", "list[int]", "the list without duplicates, in first-seen order",
         "    seen, out = set(), []\n    for x in items:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
         "    return out", lambda r: (_ints(r, 0, 5, (4, 8)),)),
    Spec("flatten", "nested: list[list[int]]", "list[int]", "one list with the items of every inner list, in order",
         "    return [x for inner in nested for x in inner]",
         lambda r: ([_ints(r, 0, 9, (0, 3)) for _ in range(r.randint(2, 4))],)),
    Spec("chunk", "items: list[int], size: int", "list[list[int]]", "the list cut into pieces of the given size",
         "    return [items[i:i + size] for i in range(0, len(items), size)]",
         lambda r: (_ints(r, 0, 9, (3, 8)), r.randint(1, 3))),
    Spec("max_gap", "numbers: list[int]", "int", "the largest difference between two neighbouring numbers",
         "    return max(abs(b - a) for a, b in zip(numbers, numbers[1:]))", lambda r: (_ints(r, 0, 40, (3, 6)),)),
    Spec("longest_word", "sentence: str", "str", "the longest word of the sentence (the first one on a tie)",
         "    return max(sentence.split(), key=len)", lambda r: (r.choice(SENTENCES),)),
    Spec("reverse_words", "sentence: str", "str", "the sentence with its words in reverse order",
         "    return ' '.join(reversed(sentence.split()))", lambda r: (r.choice(SENTENCES),)),
    Spec("celsius_to_fahrenheit", "celsius: float", "float", "the temperature converted to Fahrenheit",
         "    return celsius * 9 / 5 + 32", lambda r: (float(r.randint(-20, 40)),)),
    Spec("factorial", "n: int", "int", "n factorial, the product of the numbers 1 to n",
         "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result", lambda r: (r.randint(0, 8),)),
    Spec("fibonacci", "n: int", "int", "the n-th Fibonacci number, with fibonacci(0) == 0",
         "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", lambda r: (r.randint(0, 15),)),
    Spec("merge_sorted", "a: list[int], b: list[int]", "list[int]", "one sorted list with the items of two sorted lists",
         "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
         "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]",
         lambda r: (sorted(_ints(r, 0, 20, (2, 4))), sorted(_ints(r, 0, 20, (2, 4))))),
    Spec("count_above", "numbers: list[int], threshold: int", "int", "how many numbers are above the threshold",
         "    return sum(1 for n in numbers if n > threshold)", lambda r: (_ints(r), r.randint(0, 10))),
    Spec("clamp", "value: int, low: int, high: int", "int", "the value limited to the range low to high",
         "    return max(low, min(high, value))", lambda r: (r.randint(-20, 40), r.randint(-5, 5), r.randint(10, 20))),
    Spec("non_decreasing", "numbers: list[int]", "bool", "True when the list is in non-decreasing order",
         "    return all(a <= b for a, b in zip(numbers, numbers[1:]))",
         lambda r: (r.choice((sorted(_ints(r)), _ints(r))),)),
    Spec("char_frequency", "text: str", "dict[str, int]", "how often each letter occurs in the text, spaces ignored",
         "    counts = {}\n    for c in text:\n        if c != ' ':\n            counts[c] = counts.get(c, 0) + 1\n    return counts",
         lambda r: (r.choice(WORDS),)),
    Spec("title_case_names", "names: list[str]", "list[str]", "the names with their first letter in upper case",
         "    return [n[:1].upper() + n[1:] for n in names]", lambda r: (r.sample(WORDS, r.randint(2, 4)),)),
    Spec("filter_long_words", "words: list[str], n: int", "list[str]", "the words longer than n letters",
         "    return [w for w in words if len(w) > n]", lambda r: (r.sample(WORDS, r.randint(3, 5)), r.randint(3, 6))),
    Spec("average", "numbers: list[float]", "float", "the mean of a non-empty list of numbers",
         "    return sum(numbers) / len(numbers)", lambda r: ([float(x) for x in _ints(r, 0, 20)],)),
    Spec("product_of_list", "numbers: list[int]", "int", "the product of all numbers in the list",
         "    result = 1\n    for n in numbers:\n        result *= n\n    return result", lambda r: (_ints(r, -3, 6, (2, 5)),)),
    Spec("swap_case", "text: str", "str", "the text with upper case letters made lower case and the other way round",
         "    return text.swapcase()", lambda r: (r.choice(("Hello World", "PyThOn", "Data Science", "aBc DeF")),)),
    Spec("count_substring", "text: str, part: str", "int", "how many times part occurs in text, overlaps included",
         "    return sum(1 for i in range(len(text) - len(part) + 1) if text[i:i + len(part)] == part)",
         lambda r: (r.choice(("banana", "aaaa", "abababa", "mississippi")), r.choice(("a", "an", "aa", "ss", "ab")))),
    Spec("rotate_left", "items: list[int], k: int", "list[int]", "the list rotated k places to the left",
         "    if not items:\n        return []\n    k %= len(items)\n    return items[k:] + items[:k]",
         lambda r: (_ints(r, 0, 9), r.randint(0, 5))),
    Spec("pairs_with_sum", "numbers: list[int], target: int", "list[tuple[int, int]]",
         "the pairs of positions (i, j), i < j, whose numbers add up to target",
         "    return [(i, j) for i in range(len(numbers)) for j in range(i + 1, len(numbers))\n"
         "            if numbers[i] + numbers[j] == target]", lambda r: (_ints(r, 0, 6, (4, 6)), r.randint(3, 9))),
    Spec("binary_string", "n: int", "str", "the binary digits of a non-negative integer, without a prefix",
         "    return bin(n)[2:]", lambda r: (r.randint(0, 64),)),
    Spec("vowel_positions", "word: str", "list[int]", "the positions of the vowels in the word",
         "    return [i for i, c in enumerate(word) if c in 'aeiou']", lambda r: (r.choice(WORDS),)),
    Spec("squares_up_to", "n: int", "list[int]", "the squares of the numbers 1 to n",
         "    return [i * i for i in range(1, n + 1)]", lambda r: (r.randint(1, 8),)),
    Spec("min_max", "numbers: list[int]", "tuple[int, int]", "the smallest and the largest number as a pair",
         "    return min(numbers), max(numbers)", lambda r: (_ints(r),)),
    Spec("common_items", "a: list[int], b: list[int]", "list[int]", "the sorted numbers that both lists contain",
         "    return sorted(set(a) & set(b))", lambda r: (_ints(r, 0, 9), _ints(r, 0, 9))),
    Spec("acronym", "phrase: str", "str", "the upper-case first letters of the phrase's words",
         "    return ''.join(w[0].upper() for w in phrase.split())", lambda r: (r.choice(SENTENCES),)),
    Spec("triangle_type", "a: int, b: int, c: int", "str",
         "'equilateral', 'isosceles' or 'scalene' for a triangle with sides a, b and c",
         "    if a == b == c:\n        return 'equilateral'\n    if a == b or b == c or a == c:\n        return 'isosceles'\n"
         "    return 'scalene'", lambda r: tuple(r.choice(((3, 3, 3), (3, 4, 5), (5, 5, 8), (2, 3, 4), (7, 7, 7))))),
    Spec("leap_year", "year: int", "bool", "True when the year is a leap year in the Gregorian calendar",
         "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
         lambda r: (r.choice((1900, 2000, 2023, 2024, 2100, 1996, 2019)),)),
    Spec("sum_of_squares", "numbers: list[int]", "int", "the sum of the squares of the numbers",
         "    return sum(n * n for n in numbers)", lambda r: (_ints(r, -5, 9),)),
    Spec("strip_punctuation", "text: str", "str", "the text without the characters . , ! ? ; :",
         "    return ''.join(c for c in text if c not in '.,!?;:')",
         lambda r: (r.choice(("Hello, world!", "Wait; what?", "Yes. No. Maybe!", "One, two: three.")),)),
    Spec("index_of_min", "numbers: list[int]", "int", "the position of the smallest number (the first one on a tie)",
         "    return numbers.index(min(numbers))", lambda r: (_ints(r),)),
    Spec("group_by_length", "words: list[str]", "dict[int, list[str]]", "the words grouped by their length",
         "    groups = {}\n    for w in words:\n        groups.setdefault(len(w), []).append(w)\n    return groups",
         lambda r: (r.sample(WORDS, r.randint(3, 5)),)),
    Spec("dedupe_letters", "word: str", "str", "the word with each letter kept at its first occurrence only",
         "    return ''.join(dict.fromkeys(word))", lambda r: (r.choice(WORDS),)),
)

PHRASING = ("Write a Python function that returns {does}.",
            "Write a Python function `{name}` that returns {does}.",
            "Write a Python function that returns {does}, with a docstring and one example.",
            "In Python, how would I write a function that returns {does}?",
            "Implement `{signature}` in Python. It should return {does}.")


COMPLETE = ("Complete the following Python function.\n\n", "Complete this Python function:\n\n",
            "Finish the implementation of this function.\n\n", "")


def _stub(spec: Spec, r: random.Random) -> str:
    """A function to complete: a signature, a docstring and doctest examples, HumanEval's shape."""
    examples = []
    for _ in range(r.choice((1, 2, 2, 3))):
        args = spec.args(r)
        shown = ", ".join(repr(a) for a in args)
        examples.append(f"    >>> {spec.name}({shown})\n    {spec.call(*args)!r}")
    doc = f"    \"\"\"Return {spec.does}.\n\n" + "\n".join(examples) + "\n    \"\"\"\n"
    head = "from typing import List\n\n\n" if r.random() < 0.3 else ""
    params = spec.params.replace("list[", "List[") if head else spec.params
    returns = spec.returns.replace("list[", "List[") if head else spec.returns
    return f"{head}def {spec.name}({params}) -> {returns}:\n{doc}"


def _task(r: random.Random) -> str:
    spec = r.choice(SPECS)
    kind = r.choices(("stub", "write", "explain", "test"), weights=(5, 3, 1, 1))[0]
    if kind == "stub":
        return r.choice(COMPLETE) + _stub(spec, r)
    if kind == "write":
        signature = f"{spec.name}({spec.params}) -> {spec.returns}"
        return r.choice(PHRASING).format(does=spec.does, name=spec.name, signature=signature)
    if kind == "explain":
        return f"Explain what this Python function does, briefly:\n\n```python\n{spec.source()}```"
    return f"Write one pytest test for this function:\n\n```python\n{spec.source()}```"


MAX_DRAWS = 50  # per row: the set holds thousands of distinct prompts; a row that cannot be found is an error


def code_conversations(n: int, seed: int = TRAIN_SEED) -> list[list[dict[str, str]]]:
    """`n` single-turn chats (a user prompt, no reply: regen writes it) drawn from `seed`, no prompt
    twice: greedy regen answers a repeated prompt with the same reply, which trains twice on one row
    and, when the copy lands in the validation split (speculators' last rows), inflates its figures."""
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(n):
        for _ in range(MAX_DRAWS):
            prompt = _task(rng)
            if prompt not in seen:
                break
        else:
            raise ValueError(f"builtin:code: no new prompt in {MAX_DRAWS} draws after {len(out)} rows")
        seen.add(prompt)
        out.append([{"role": "user", "content": prompt}])
    return out
