"""The form of a math answer: what an answer may say around its value (rule 2 of ``tasks.math``).

After its wrappers are removed (``unwrap_answer``), an answer is read by this grammar (``read_answer``)::

    answer   := [lead] [label relation] [hedge] [currency] value [unit]
    lead     := [so | thus | therefore | hence [","]] [the [final] answer [is | =] [":"] | it is | it's]
    label    := a name: x, x_1, x_{12}, x', \\theta, AB, ABC, f(2), P(A), f^{-1}(3), \\sin x, \\sin(A), \\angle B,
                m\\angle ABC, \\angle 1, \\overline{AB}, m \\widehat{AB}, \\vec{v}, |AB|  (``_LABEL``), or up to
                three words of QUANTITIES, plain or in \\text{}: Area, \\text{Total cost}  (``_QUANTITY_LABEL``)
    relation := "=", or a hedge: \\approx, ≈, \\simeq, \\sim
    hedge    := "~" | about | approximately | approx | around | roughly | nearly | almost | circa
    currency := "$" | "\\$"
    value    := a number or a LaTeX expression: what is compared; thousands separators between a digit and
                three digits are dropped first, commas and the spaces LaTeX groups digits with (10{,}000,
                10\\,000, 10\\ 000: ``_THOUSANDS_SEPARATOR``)
    unit     := after a value without letters: a degree sign (45°, 45^\\circ), a percent sign, or words of
                UNITS joined by spaces or "/" (cm, m/s, cm^2, \\text{ square units}, 12 apples), plain or in
                \\text{}/\\mathrm{}

``refusal(answer, truth, approximate)`` names what makes an answer wrong by its form alone. Unless the ground
truth has the same thing:
  character   a character other than ASCII letters, digits, spaces, the signs in _ASCII_SIGNS and
              KNOWN_SYMBOLS: look-alikes (Cyrillic "б", Greek "Ο" for a zero, fullwidth "６"), "¬", "?";
  command     a LaTeX command outside KNOWN_COMMANDS: \\cancel, \\nequiv, \\not, \\neg, \\lor, \\pm,
              \\infty, \\Gamma, \\exp (fast-growing functions come only with a truth that has them);
  unbalanced  brackets or braces that do not pair;
  relation    a relation other than "label = value" (or a hedge): between two values (5 = 6), more than one
              (x = y = 6), or another relation (<, \\le, \\neq, \\equiv); a truth with the same relations, in
              the same order, has the whole answers compared;
  spans       a "$" that is not the currency sign: what is left of several math spans ("5$ $6");
  several     a comma, semicolon, "&" or "\\\\" outside every bracket: several values ("6, 6"; a tuple
              "(6, 6)" is one value);
  word        a word of two or more letters in the value or the label (point names such as ABC and a
              quantity label's words aside),
              plain or in \\text{}: prose and hedges that are not the grammar's ("perhaps 6", "6 maybe",
              "6 \\text{ is bogus}", "6 and 7", "P(wrong) = 6"), a trailing word that is not a unit;
and in any case:
  hedge       a hedge when the truth is exact: a precision (``approximate``) or a hedged truth allows it;
  label       a label other than the truth's where the truth is an equation (``y = 2x + 1``: a value with
              letters); otherwise a label is a name and is not compared (``AB = 5`` against ``5`` or ``x = 5``);
  boxed       a \\boxed{} or \\fbox{} that is not the whole value: math-verify reads only the box ("7\\boxed{6}");
  empty       no value ("=", "$").
Units are not compared: both sides drop theirs. A text is whitespace-collapsed first and is at most
MAX_ANSWER_CHARS long when ``tasks.math`` hands it over; every pattern is linear all the same (no unbounded
quantifier is nested in another, and no two next to each other can match the same characters).

The screen (``safe_for_math_verify``, at the end) is the other static check of an answer's text: what of it
math-verify may evaluate without running for seconds or forever.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# No benchmark answer comes near this; a longer answer is wrong without being parsed (a 10,000-digit number
# costs nothing to reject and would cost math-verify and Decimal real time).
MAX_ANSWER_CHARS = 200

# Wrappers a model puts around a final answer: $...$, $$...$$, \(...\), \[...\], \boxed{...}, \fbox{...},
# Markdown's bold **...**.
_WRAPPERS = (
    re.compile(r"\$\$(.*)\$\$", re.DOTALL),
    re.compile(r"\$(.*)\$", re.DOTALL),
    re.compile(r"\\\((.*)\\\)", re.DOTALL),
    re.compile(r"\\\[(.*)\\\]", re.DOTALL),
    re.compile(r"\\(?:boxed|fbox)\s*\{(.*)\}", re.DOTALL),
    re.compile(r"\*\*(.*)\*\*", re.DOTALL),
)


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def unwrap_answer(text: str) -> str:
    """``text`` stripped of surrounding whitespace, a final period, and whole-answer wrappers (``$...$``,
    ``\\(...\\)``, ``\\[...\\]``, ``\\boxed{...}``, ``**...**``), repeatedly: ``$\\boxed{5}$.`` -> ``5``."""
    text = text.strip()
    for _ in range(4):
        before = text
        if text.endswith(".") and not text.endswith(".."):
            text = text[:-1].rstrip()
        for wrapper in _WRAPPERS:
            match = wrapper.fullmatch(text)
            if match and _balanced(match.group(1)) and "$" not in match.group(1):
                text = match.group(1).strip()
                break
        if text == before:
            break
    return text


# ---------------------------------------------------------------------------------------------- vocabulary

_GREEK = (
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi pi rho sigma "
    "tau upsilon phi varphi chi psi omega Delta Theta Lambda Xi Pi Sigma Phi Psi Omega ell"
)
# Commands an answer may use without the truth having them: numbers, arithmetic, brackets, the elementary
# functions, binomials, geometry names, formatting and spacing. Left out on purpose: negations and logic
# (\not, \neg, \lor), marks (\cancel), relations (handled as relations), \pm/\mp, \infty (sympy's simplify
# calls "\sqrt{\infty}" equal to 6 or not, by hash seed), and the functions that grow faster than any
# power (\Gamma, \exp, \sinh, \cosh, \operatorname): a truth that has one enables it (the screen bounds it).
KNOWN_COMMANDS = frozenset(
    (
        "frac dfrac tfrac cfrac sqrt cdot times div ast pi circ degree prime "
        "left right middle big Big bigg Bigg bigl bigr Bigl Bigr biggl biggr "
        "lfloor rfloor lceil rceil langle rangle lvert rvert vert lbrace rbrace "
        "sin cos tan cot sec csc arcsin arccos arctan log ln lg max min gcd det binom dbinom tbinom choose "
        "angle measuredangle triangle overline widehat overarc arc overrightarrow overleftrightarrow vec hat "
        "bar tilde odot cap cup mid setminus emptyset varnothing "
        "text textrm textnormal textbf textit mathrm mathbf mathit boldsymbol mbox displaystyle boxed fbox "
        "quad qquad begin end approx simeq sim " + _GREEK
    ).split()
) | frozenset("\\ { } , ; : ! % $".split() + [" "])
KNOWN_ENVIRONMENTS = frozenset("matrix pmatrix bmatrix Bmatrix vmatrix Vmatrix smallmatrix".split())
# Non-ASCII characters with a plain mathematical meaning ("∞", like \infty, needs a truth with it). Relation
# signs (≤, ≠, ≈, ...) are relations.
KNOWN_SYMBOLS = frozenset("−×÷·π√°²³")
_ASCII_SIGNS = frozenset("+-*/^_()[]{}|!.,;:&'=<>$%~\\ ")  # ":" is a ratio (3:4)

# Every relation, by its canonical name: synonyms compare equal ("≤", "\le", "\leq", "\leqslant").
_RELATIONS = {
    "=": "=", "<": "<", ">": ">", "≤": "le", "≥": "ge", "≠": "ne", "≡": "equiv", "≅": "cong", "≈": "approx",
    "≃": "simeq", "\\le": "le", "\\leq": "le", "\\leqslant": "le", "\\ge": "ge", "\\geq": "ge",
    "\\geqslant": "ge", "\\lt": "<", "\\gt": ">", "\\ne": "ne", "\\neq": "ne", "\\equiv": "equiv",
    "\\cong": "cong", "\\approx": "approx", "\\simeq": "simeq", "\\sim": "sim", "\\to": "to",
    "\\rightarrow": "to", "\\Rightarrow": "implies", "\\implies": "implies", "\\iff": "iff",
    "\\Leftrightarrow": "iff", "\\in": "in", "\\notin": "notin", "\\propto": "propto", "\\ll": "ll",
    "\\gg": "gg", "\\parallel": "parallel", "\\perp": "perp", "\\subset": "subset", "\\subseteq": "subseteq",
}  # fmt: skip
_HEDGE_RELATIONS = frozenset({"approx", "simeq", "sim"})
_HEDGE_WORDS = frozenset("about approximately approx around roughly nearly almost circa".split())

# Units: measures, then counted things (the embedded data's and common word problems' nouns). A unit word
# may take a plural "s"/"es". None of them changes what the number says (no "more", "less", "times").
UNITS = frozenset(
    (
        "mm cm dm km in inch ft foot feet yd yard mi mile meter metre millimeter millimetre centimeter "
        "centimetre kilometer kilometre unit square sq cubic cu px pixel "
        "degree deg rad radian sec second min minute hr hour day week month yr year ms "
        "mg kg gram kilogram lb pound oz ounce ton tonne ml liter litre gal gallon cc "
        "dollar cent euro yuan usd mph kph kmh percent "
        "apple pencil sticker marble cookie stamp box bag slice piece shape circle triangle ticket toy book "
        "page notebook sandwich student person people child children kid adult man men woman women boy girl "
        "friend item object ball car egg coin card flower tree bottle cup cake pie candy candies animal dog "
        "cat bird fish point game step"
    ).split()
)
_SINGLE_LETTER_UNITS = frozenset("m g s h L".split())
_UNIT_JOINS = re.compile(r"/|~|\\[,;: ]")

# ---------------------------------------------------------------------------------------------- tokens

# One token per match, tried in this order; every alternative is a fixed shape or a single run of one
# character class, so a text is tokenised in one linear pass. Whitespace is collapsed to single spaces first.
_TOKEN = re.compile(
    r"(?P<space> |~|\\[,;:! ]|\\q?quad(?![A-Za-z]))"
    r"|(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<degree>\^ ?\{ ?\\circ ?\}|\^ ?\\circ(?![A-Za-z])|°|\\degree(?![A-Za-z]))"
    r"|(?P<power>\^ ?(?:\{ ?[23] ?\}|[23](?![0-9]))|[²³])"
    r"|(?P<percent>\\?%)"
    r"|(?P<text>\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|boldsymbol|mbox) ?\{[^{}]*\})"
    r"|(?P<env>\\(?:begin|end) ?\{[^{}]*\})"
    r"|(?P<command>\\(?:[A-Za-z]+|[^A-Za-z])?)"
    r"|(?P<word>[A-Za-z]+)"
    r"|(?P<char>.)",
    re.ASCII | re.DOTALL,
)
_OPEN = frozenset(["(", "[", "{", "\\{", "\\langle", "\\lfloor", "\\lceil"])
_CLOSE = frozenset([")", "]", "}", "\\}", "\\rangle", "\\rfloor", "\\rceil"])
_SEPARATORS = frozenset([",", ";", "&", "\\\\"])
_DOLLARS = frozenset(["$", "\\$"])
_COMMAND_NAME = re.compile(r"\\([A-Za-z]+|.?)", re.DOTALL)
_ENVIRONMENT = re.compile(r"\\(?:begin|end) ?\{([^{}]*)\}")
_TEXT_CONTENT = re.compile(r"\{([^{}]*)\}")
_WORD = re.compile(r"[A-Za-z]{2,}")
# A thousands separator: between a digit and exactly three digits, a comma ("6,000", "6{,}000", "6,\\!000") or
# one of the spaces LaTeX writers group digits with (siunitx and ISO style: "10\\,000", "10\\ 000", "10\\!000",
# "10{\\,}000", "10\\thinspace 000"). Never between other digit counts: "1,2" and "1\\,2" stay two numbers, not 12.
_THOUSANDS_SEPARATOR = re.compile(
    r"(?<=\d)(?:(?:,|\{,\})(?:\\!)?|\\[,! ]|\{\\,\}|\\thinspace ?)(?=\d{3}(?!\d))"
)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str

    @property
    def relation(self) -> str | None:
        return _RELATIONS.get(self.text) if self.kind in ("char", "command") else None

    @property
    def written(self) -> str:
        """What the token writes: a word, or the content of a \\text{}-like group ("" for anything else)."""
        if self.kind == "text":
            return _TEXT_CONTENT.search(self.text).group(1)
        return self.text if self.kind == "word" else ""


def _tokens(text: str) -> list[_Token]:
    return [_Token(match.lastgroup, match.group()) for match in _TOKEN.finditer(text)]


def _joined(tokens: list[_Token]) -> str:
    return "".join(token.text for token in tokens).strip()


def _words(tokens: list[_Token], points: bool = True) -> set[str]:
    """Words of two or more letters, plain or inside \\text{}-like groups, lower-cased; without ``points``,
    not the upper-case runs that name points (AB, ABC)."""
    found = set()
    for token in tokens:
        found.update(word.lower() for word in _WORD.findall(token.written) if points or not word.isupper())
    return found


def _is_unit(token: _Token) -> bool:
    """A unit word, or a \\text{}-like group of unit words (``\\text{ m/s}``, ``\\mathrm{cm}``)."""
    if token.kind == "text":  # "/" joins units; "~" and "\\," space them (\\mathrm{~cm})
        words = _UNIT_JOINS.sub(" ", token.written).split()
        return bool(words) and all(_is_unit(_Token("word", word)) for word in words)
    if token.kind != "word":
        return False
    if len(token.text) == 1:
        return token.text in _SINGLE_LETTER_UNITS
    word = token.text.lower()
    plural = (word.endswith("s") and word[:-1] in UNITS) or (word.endswith("es") and word[:-2] in UNITS)
    return word in UNITS or plural


def _unit_start(tokens: list[_Token]) -> int:
    """Where a trailing unit begins in ``tokens`` (``len(tokens)`` when there is none), read from the end: a
    degree or percent sign (a degree may name its scale: 30°C), or unit words, each with an optional
    abbreviation point and ``^2``/``^3``, separated by spaces or one "/" ("sq. units", "cm^2", "m/s")."""
    end = len(tokens)
    while end and tokens[end - 1].kind == "space":
        end -= 1
    if end > 1 and tokens[end - 2].kind == "degree" and tokens[end - 1].written.strip() in ("C", "F"):
        return end - 2
    if end and tokens[end - 1].kind in ("degree", "percent"):
        return end - 1
    start, i = len(tokens), end
    while True:
        j = i - 1 if i and tokens[i - 1].kind == "power" else i
        j = j - 1 if j > 1 and tokens[j - 1].text == "." and tokens[j - 2].kind == "word" else j
        if not (j and _is_unit(tokens[j - 1])):
            return start
        start = i = j - 1
        # what joins it to a unit before it: spaces, or one "/" with optional spaces around it
        k = i
        while k and tokens[k - 1].kind == "space":
            k -= 1
        if k and tokens[k - 1].text == "/":
            k -= 1
            while k and tokens[k - 1].kind == "space":
                k -= 1
        if k == i or not k or (tokens[k - 1].kind not in ("word", "text", "power") and tokens[k - 1].text != "."):
            return start
        i = k


# ---------------------------------------------------------------------------------------------- labels

_G = r"\\(?:" + "|".join(_GREEK.split()) + r")(?![A-Za-z])"
_NAME = rf"(?:{_G}|[A-Z]{{1,4}}(?![A-Za-z])|[a-z](?![A-Za-z]))"
_SUBSCRIPT = r"(?:_(?:\{[A-Za-z0-9 ,]{1,12}\}|[A-Za-z0-9]))?'{0,2}"
_SYMBOL = _NAME + _SUBSCRIPT
_ARGUMENT = r"\([^()=<>]{1,24}\)"
_ACCENT = (
    r"\\(?:overline|widehat|overarc|arc|overrightarrow|overleftrightarrow|vec|hat|bar|tilde|mathbf|boldsymbol)"
)
_FIGURE = r"\\(?:angle|measuredangle|triangle|odot)"
_FUNCTION = r"\\(?:sin|cos|tan|cot|sec|csc|log|ln)"
# The quantity an answer gives, named in words on the left of "=" ("Area = 24", "\\text{Total cost} = 24"): a
# closed list, so that no word that changes what the value says ("not", "wrong", "maybe") passes for a label.
QUANTITIES = frozenset(
    (
        "area perimeter circumference volume surface length width height depth radius diameter distance side base "
        "hypotenuse angle slope speed velocity time rate cost price total sum difference product quotient ratio "
        "probability average mean median mode range value answer result number count amount weight mass age"
    ).split()
)
_QUANTITY = "(?:" + "|".join(sorted(QUANTITIES)) + ")"
_QUANTITY_LABEL = re.compile(
    rf"(?i:{_QUANTITY}(?: {_QUANTITY}){{0,2}}"
    rf"|\\(?:text|textrm|textnormal|textbf|textit|mathrm|mbox) ?\{{ ?{_QUANTITY}(?: {_QUANTITY}){{0,2}} ?\}})",
    re.ASCII,
)
# A name on the left of "=" (text whitespace-collapsed and stripped). Every repetition is bounded.
_LABEL = re.compile(
    rf"(?:m ?)?(?:{_FIGURE} ?(?:{_SYMBOL}|\d{{1,2}})|{_ACCENT} ?\{{ ?{_SYMBOL} ?\}}"
    rf"|{_SYMBOL}(?:\^\{{?-1\}}?)? ?(?:{_ARGUMENT})?|{_FUNCTION} ?(?:{_ARGUMENT}|{_SYMBOL})"
    rf"|\| ?{_SYMBOL} ?\||\\lvert ?{_SYMBOL} ?\\rvert)",
    re.ASCII,
)
_LEAD = re.compile(
    r"(?:(?:so|thus|therefore|hence) ?,? )?(?:(?:the )?(?:final )?answer(?: is| =)? ?:? |it is |it['’]s )?",
    re.IGNORECASE,
)
# A leading math span followed by what is outside it ("$5$ cm"): the dollars are dropped.
_LEADING_SPAN = re.compile(r"\$([^$]+)\$( [^$]*)?")


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Form:
    """What the grammar reads in an answer. ``value`` (no lead, label, hedge, currency or unit) is what is
    compared; ``text`` is the whole answer after its lead, compared instead when either side is a relation."""

    text: str
    value: str
    label: str
    hedged: bool
    relation: bool  # a relation other than "label = value" (or a hedge): compared as a whole
    relations: tuple[str, ...]  # every relation, canonical names in order
    commands: frozenset[str]
    environments: frozenset[str]
    characters: frozenset[str]
    words: frozenset[str]  # words of two or more letters in the value or label (not point names)
    all_words: frozenset[str]  # words anywhere (for the truth's side)
    several: bool  # a separator outside all brackets
    stray_dollar: bool
    balanced: bool
    value_has_letters: bool


def read_answer(text: str) -> Form:
    """``text`` (unwrapped) read by the grammar of the module docstring; never raises."""
    text = _THOUSANDS_SEPARATOR.sub("", " ".join(text.split()))
    lead = _LEAD.match(text)
    if lead.end():
        text = unwrap_answer(text[lead.end() :])
    span = _LEADING_SPAN.fullmatch(text)
    if span:
        text = (span.group(1) + (span.group(2) or "")).strip()
    tokens = _tokens(text)
    depth, balanced, several = 0, True, False
    for token in tokens:
        if token.text in _OPEN or token.text.startswith("\\begin"):
            depth += 1
        elif token.text in _CLOSE or token.text.startswith("\\end"):
            depth -= 1
            balanced = balanced and depth >= 0
        elif depth == 0 and token.text in _SEPARATORS:
            several = True
    relations = [(i, token.relation) for i, token in enumerate(tokens) if token.relation]
    label, label_words, body, relation, hedged = "", set(), tokens, False, False
    if len(relations) == 1:
        index, name = relations[0]
        left = _joined(tokens[:index])
        quantity = _QUANTITY_LABEL.fullmatch(left)  # "Area = 24": its words are the vetted QUANTITIES
        if (name == "=" or name in _HEDGE_RELATIONS) and (not left or quantity or _LABEL.fullmatch(left)):
            label, body, hedged = left, tokens[index + 1 :], name != "="
            label_words = set() if quantity else _words(tokens[:index], points=False)  # "wrong" in P(wrong) = 6
        else:
            relation = True
    elif relations:
        relation = True
    # a hedge ("~", a hedge word with the period of "approx."), then a currency sign, open the value
    body = body[1:] if body and body[0].text == " " else body
    if body and (body[0].text == "~" or (body[0].kind == "word" and body[0].text.lower() in _HEDGE_WORDS)):
        hedged, body = True, body[1:]
        body = body[1:] if body and body[0].text == "." else body
    body = _strip_spaces(body)
    dollars = sum(token.text in _DOLLARS for token in tokens)
    if body and body[0].text in _DOLLARS:
        dollars, body = dollars - 1, _strip_spaces(body[1:])
    value = body
    if not relation:
        # a unit follows a value without letters ("2x m" is an expression) that ends as a value does
        head = _strip_spaces(body[: _unit_start(body)])
        if head and not any(token.kind == "word" for token in head) and _ends_a_value(head[-1]):
            value = head
    return Form(
        text=text,
        value=unwrap_answer(_joined(value)),  # "x = \\boxed{5}", "\\boxed{5} cm": a box that is the whole value
        label=label.replace(" ", ""),
        hedged=hedged,
        relation=relation,
        relations=tuple(name for _, name in relations),
        commands=frozenset(_COMMAND_NAME.findall(text)),
        environments=frozenset(_ENVIRONMENT.findall(text)),
        characters=frozenset(text),
        words=frozenset(_words(value) | label_words),
        all_words=frozenset(_words(tokens)),
        several=several,
        stray_dollar=dollars > 0,
        balanced=balanced and depth == 0,
        value_has_letters=any(token.kind == "word" for token in value),
    )


def _ends_a_value(token: _Token) -> bool:
    """Whether a value can end with ``token`` (a number, a closing bracket, a constant; not "+" or \\frac)."""
    if token.kind in ("number", "degree", "power", "text", "percent"):
        return True
    return token.text in _CLOSE or token.text in ("!", "'", "|", "\\pi", "\\infty", "\\rvert")


def _strip_spaces(tokens: list[_Token]) -> list[_Token]:
    start, end = 0, len(tokens)
    while start < end and tokens[start].kind == "space":
        start += 1
    while end > start and tokens[end - 1].kind == "space":
        end -= 1
    return tokens[start:end]


def _odd_character(char: str) -> bool:
    if char.isascii():
        return not (char.isalnum() or char in _ASCII_SIGNS)
    return char not in KNOWN_SYMBOLS and char not in _RELATIONS


def refusal(answer: Form, truth: Form, approximate: bool) -> str | None:
    """Why ``answer`` is wrong by its form against ``truth`` (the names of the module docstring), or None.
    ``approximate``: the sample has a precision, so a hedge is allowed."""
    if any(_odd_character(char) for char in answer.characters - truth.characters):
        return "character"
    if any(name not in KNOWN_COMMANDS for name in answer.commands - truth.commands - _relation_names(answer)):
        return "command"
    if answer.environments - truth.environments - KNOWN_ENVIRONMENTS:
        return "command"
    if not answer.balanced and truth.balanced:
        return "unbalanced"
    if (answer.relation or truth.relation) and answer.relations != truth.relations:
        return "relation"
    if answer.hedged and not (approximate or truth.hedged):
        return "hedge"
    if answer.stray_dollar and not truth.stray_dollar:
        return "spans"
    if answer.several and not truth.several:
        return "several"
    if answer.words - truth.all_words:
        return "word"
    if "\\boxed" in answer.value or "\\fbox" in answer.value:  # math-verify reads only the box of "7\\boxed{6}"
        return "boxed"
    if not answer.value:
        return "empty"
    if answer.label and truth.label and truth.value_has_letters and answer.label != truth.label:
        return "label"
    return None


def _relation_names(form: Form) -> frozenset[str]:
    """The command names of ``form``'s relations (governed by the relation rule, not the command rule)."""
    names = (name for name, canonical in _RELATIONS.items() if canonical in form.relations)
    return frozenset(name[1:] for name in names if name.startswith("\\"))


# ---------------------------------------------------------------------------------------------- the screen

# Limits of the static screen. Each was measured on this project's machine with math-verify 0.9 / sympy:
# nesting depth 7 takes 0.3 s and 10 takes 0.8 s (500 takes 5 s); "(a+b+c+d+e+f)^{9}" 6 s and
# "(a+b+c+d)^{99}" never finished; "\sin(B^{99})" for a 40-digit B 2.4 s; "\binom{10^{10}}{10^{5}}" 22 s;
# "(10^{10})!" and "9^{9^{9^{9}}}" never finished. The worst cases we found that the screen lets through
# ("\sin(999^{99})", "(x+1)" forty times) take about 0.5 s.
MAX_NESTING = 5
MAX_SCREENED_DIGITS = 20
MAX_CARETS = 2
MAX_EXPONENT_DIGITS = 2
# digits of the largest number written x product of the numeric exponents: a bound on the digits of the
# largest integer sympy may build ("999^{99}" -> 297; "(10^{99})^{99}" -> 19,602 is refused).
MAX_POWER_DIGITS = 400
# With free variables, products and powers expand symbolically ("(a+b+c+d+e+f)" nine times over: 10 s;
# "(a+b+c)" 28 times: 1.5 s): at most 3 distinct letters, 4 brackets, one power with an exponent <= 3.
MAX_SYMBOLIC_EXPONENT = 3
MAX_VARIABLES = 3
MAX_SYMBOLIC_BRACKETS = 4
MAX_FACTORIAL_DIGITS = 2
# Functions that grow faster than any power, which sympy evaluates exactly or to full precision. Nested, of a
# power or of a large number they never finished ("\Gamma(\Gamma(\Gamma(5)))"; "\Gamma(10^{99})" and
# "\Gamma(99!)" are factorials of huge numbers; "\lfloor\exp(\exp(22))\rfloor" needs the 1.5e9 digits of
# e^(e^22); "\sinh(10^{10})", "\csch(10^{99})" and "\lfloor\sinh(99)^{99}\rfloor" ran past 5 s), and beside a
# power or a factorial they cost seconds ("\cosh(99)^{99}" 1.1-2.7 s, "\exp(99)\cdot 99!" 0.9 s on a busy
# machine). So at most one per answer, with no power, factorial or binomial anywhere in the answer, no digit
# run longer than an exponent's (\exp(n) is e^n, \Gamma(n) is (n-1)!), and an argument (the bracket after it,
# else the rest of the answer) of at most MAX_GROWING_NUMBERS numbers, letters and \frac only
# ("\Gamma(99 \cdot 99 \cdot 99)" is 970298!; "\exp(\sqrt{99})" took 0.9 s). \operatorname names any function,
# so it counts as one of them. Screened worst cases: see WORST_SCREENED in tests/test_math.py.
_GROWING = re.compile(r"\\(?:Gamma|exp|sinh|cosh|tanh|coth|sech|csch|operatorname)(?![A-Za-z])")
MAX_GROWING_NUMBERS = 2
# Alternatives that start with different characters: linear.
_GROWING_ARGUMENT = re.compile(
    r"(?:[0-9A-Za-z.,+\-/ (){}\[\]]|\\[dtc]?frac(?![A-Za-z])|\\(?:left|right)(?![A-Za-z]))*"
)
# Binomials are computed exactly too: "\binom{9999}{5000}" 0.03 s, "\binom{99999}{50000}" 0.7 s,
# "\binom{999999}{500000}" over 20 s ("\binom{99999999999999999999}{9999999999}" never finished).
MAX_BINOMIAL_DIGITS = 4

_FORBIDDEN = re.compile(r"\*\*|\\(?:sum|prod|int|iint|oint|lim)(?![A-Za-z])")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_DIGIT_RUN = re.compile(r"\d+")


def _exponent_at(text: str, caret: int) -> tuple[str, int]:
    """The exponent after the ``^`` at index ``caret`` (a ``{...}`` group, a ``\\command`` or one character)
    and the index just after it."""
    i = caret + 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return "", i
    if text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j], j + 1
        return text[i + 1 :], len(text)
    if text[i] == "\\":
        match = _COMMAND.match(text, i)
        if match:
            return match.group(0), match.end()
    return text[i], i + 1


def _group_end(text: str, start: int) -> int:
    """The index after the bracket that closes the one at ``start`` (the end of ``text`` when none does)."""
    depth = 0
    for i in range(start, len(text)):
        depth += 1 if text[i] in "([{" else -1 if text[i] in ")]}" else 0
        if depth == 0:
            return i + 1
    return len(text)


def _growing_argument(text: str, end: int) -> str:
    """The argument of the fast-growing function whose name ends at ``end``: the bracketed group after it
    (after \\operatorname's name and a \\left), or, with no bracket, the rest of the text."""
    rest = text[end:].lstrip()
    if text[:end].endswith("operatorname") and rest[:1] == "{":
        rest = rest[_group_end(rest, 0) :].lstrip()
    if rest.startswith("\\left"):
        rest = rest[len("\\left") :].lstrip()
    return rest[: _group_end(rest, 0)] if rest[:1] in ("(", "[", "{") else rest


def safe_for_math_verify(text: str) -> bool:
    """Whether ``text`` is small and tame enough to hand to math-verify (see the limits above).

    Refused: longer than MAX_ANSWER_CHARS; brackets nested deeper than MAX_NESTING; a digit run longer than
    MAX_SCREENED_DIGITS; ``**``, sums, products, integrals, limits; more than MAX_CARETS powers, a power of a
    power, an exponent holding ``^``/``!`` or a number of more than MAX_EXPONENT_DIGITS digits, or powers
    that could build an integer of more than MAX_POWER_DIGITS digits; a factorial of anything but a number of
    at most MAX_FACTORIAL_DIGITS digits; a binomial together with a power or a factorial, or with a number of
    more than MAX_BINOMIAL_DIGITS digits; more than one fast-growing function (``_GROWING``), or one beside a
    power, a factorial, a binomial or a number of more than MAX_EXPONENT_DIGITS digits, or of an argument with
    more than MAX_GROWING_NUMBERS numbers or a command other than \\frac; and, with free
    variables (letters outside LaTeX commands and ``\\text{}``), more than MAX_VARIABLES of them, more than
    MAX_SYMBOLIC_BRACKETS brackets, more than one power or an exponent above MAX_SYMBOLIC_EXPONENT.
    """
    if len(text) > MAX_ANSWER_CHARS or _FORBIDDEN.search(text):
        return False
    depth = 0
    for char in text:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth > MAX_NESTING:
            return False
    digit_runs = _DIGIT_RUN.findall(text)
    longest = max((len(run) for run in digit_runs), default=0)
    if longest > MAX_SCREENED_DIGITS:
        return False
    # Factorials: only of a short literal number ("5!", "12!").
    for index, char in enumerate(text):
        if char == "!":
            before = text[:index].rstrip()
            digits = len(before) - len(before.rstrip("0123456789"))
            if digits == 0 or digits > MAX_FACTORIAL_DIGITS:
                return False
    growing = list(_GROWING.finditer(text))
    if growing:
        if len(growing) > 1 or longest > MAX_EXPONENT_DIGITS or "^" in text or "!" in text:
            return False
        if "binom" in text or "choose" in text:
            return False
        argument = _growing_argument(text, growing[0].end())
        if len(_DIGIT_RUN.findall(argument)) > MAX_GROWING_NUMBERS:
            return False
        if not _GROWING_ARGUMENT.fullmatch(argument):
            return False
    carets = [i for i, char in enumerate(text) if char == "^"]
    if ("binom" in text or "choose" in text) and (carets or "!" in text or longest > MAX_BINOMIAL_DIGITS):
        return False
    if len(carets) > MAX_CARETS:
        return False
    exponent_product = 1
    largest_exponent = 0
    for caret in carets:
        exponent, end = _exponent_at(text, caret)
        if not exponent or "^" in exponent or "!" in exponent:
            return False
        rest = text[end:].lstrip(" }")
        if rest.startswith("^"):  # a^b^c, {a^b}^c
            return False
        runs = _DIGIT_RUN.findall(exponent)
        if any(len(run) > MAX_EXPONENT_DIGITS for run in runs):
            return False
        value = max((int(run) for run in runs), default=1)
        exponent_product *= max(value, 1)
        largest_exponent = max(largest_exponent, value)
    if carets and max(longest, 1) * exponent_product > MAX_POWER_DIGITS:
        return False
    letters = set(re.findall(r"[A-Za-z]", _COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text))))
    if letters:
        brackets = sum(text.count(bracket) for bracket in "([{")
        if len(letters) > MAX_VARIABLES or brackets > MAX_SYMBOLIC_BRACKETS:
            return False
        if len(carets) > 1 or largest_exponent > MAX_SYMBOLIC_EXPONENT:
            return False
    return True
