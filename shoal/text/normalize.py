"""Spoken-form text normalisation for TTS (the API's ``normalize: true``).

``normalize_text("On 03/15/2024 at 3:45 pm it cost $3.50.")`` →
``"On March fifteenth, twenty twenty-four at three forty-five PM it cost three
dollars and fifty cents."``

English rules (applied in this order to every stretch of text outside the
protected spans):

* **Protected, never touched**: ``<|...|>`` tags (``<|speaker:0|>``),
  bracketed control tags (``[laughing]``, ``[whispers softly]``), and every
  whitespace-delimited token containing a letter of a non-Latin script
  (``我有3个`` stays as is).
* **Phone numbers** ``555-123-4567``, ``(555) 123-4567``, ``555-1234`` → digit
  by digit in groups.
* **Dates**: ISO ``2024-03-15``; slashed ``03/15/2024`` (month first, or day
  first when the first field is > 12; a 2-digit year ``yy`` means 20yy when
  yy < 50, else 19yy); ``March 15, 2024`` / ``Mar. 15th``; ``15 March 2024``
  → ``the fifteenth of March, twenty twenty-four``.
* **Times**: ``3:45 pm`` → ``three forty-five PM``; ``3pm`` → ``three PM``;
  ``14:30`` → ``fourteen thirty``; ``9:05`` → ``nine oh five``; ``3:00`` →
  ``three o'clock``; ``14:00`` → ``fourteen hundred``; seconds ``h:mm:ss`` add
  ``and N seconds``.
* **Currency** ``$ € £ ¥ ₹ ₩`` before (or after) the amount and ISO codes
  (``USD 5``, ``5 EUR``): exactly two decimals read as units and subunits
  (``$3.50`` → three dollars and fifty cents, ``$0.99`` → ninety-nine cents,
  ``£1.25`` → one pound and twenty-five pence); other decimals as decimals;
  scale words and suffixes (``$2.5 million``, ``$5M``, ``$3bn``, ``$10k``);
  ranges (``$5-10`` → five to ten dollars); ``-$5`` → minus five dollars.
* **Percentages** ``45%`` → forty-five percent, with ranges ``5-10%``.
* **Decades** ``1990s`` → nineteen nineties, ``'80s`` / ``80s`` → eighties.
* **Ordinals** ``1st``, ``22nd``, ``101st``.
* **Units** after a number (a table below; case-sensitive), singular only
  for exactly ``1``: ``1 km`` → one kilometer, ``10kg`` → ten kilograms,
  ``12 °C`` → twelve degrees Celsius, ``5-10 km`` → five to ten kilometers,
  ``1920x1080`` → … by …, ``2x`` → two times.
* **Fractions** ``1/2`` → one half, ``3/4`` → three quarters, ``2 1/2`` → two
  and one half, ``½``; when the numerator is not smaller than the
  denominator (and not a small improper fraction such as ``3/2``) the two
  numbers are read as such: ``24/7`` → twenty-four seven.
* **Ranges** ``5-10`` → five to ten (``1999-2005`` reads both as years).
* **Negatives** ``-42`` (a minus sign after whitespace, an opening bracket
  or the start) → minus forty-two.
* **Four-digit numbers** 1000–2099 without separators — year or count?
  In order: a year when ``AD``/``BC``/``CE`` follows or the word before is
  a strong year cue (``in``, ``since``, ``until``, ``during``, ``circa``,
  ``year``, ``born``, a season, a month name, a possessive ``'s`` …); a count
  when the word before is a count cue (``about``, ``over``, ``nearly``,
  ``than``, ``with``, ``page`` …) or the next word is a lower-case content
  word (``1999 apples``, ``of 1500 people``; words that often follow a year,
  such as ``was``, ``and``, ``the``, ``election``, don't count); otherwise a
  year (``1999.``, ``the 2020 election``, ``from 1999 to``).  Years read as
  ``1999`` → nineteen ninety-nine, ``2005`` → two thousand five, ``2024`` →
  twenty twenty-four, ``1900`` → nineteen hundred, ``1905`` → nineteen oh
  five; counts as cardinals (one thousand nine hundred ninety-nine).
* **Dotted numbers** ``1.2.3`` / ``192.168.0.1`` → one point two point three.
* **Numbers**: thousands separators ``1,234,567``; decimals ``3.14`` → three
  point one four; a leading zero or more than 15 digits → digit by digit;
  digits glued to letters are split off (``MP3`` → MP three, ``COVID-19`` →
  COVID nineteen).  Number words are American style (no "and").
* **Symbols** ``&`` and, ``+`` plus, ``=`` equals, ``@`` at (emails: ``a at
  b dot com``), ``#1`` number one, ``#tag`` hashtag tag, ``C#`` C sharp,
  ``%`` percent, ``×`` times, ``÷`` divided by, ``±`` plus or minus, ``~5``
  about five.
* **Abbreviations** Mr./Mrs./Ms./Dr./Prof./St. … before a capitalised
  name, Jr./Sr. after one, St./Ave./Blvd./Rd./Dr. after a street name,
  ``vs.``, ``etc.``, ``e.g.``, ``i.e.``, ``approx.``, ``a.k.a.``, ``No. 5``,
  ``w/``; the sentence-final period of ``etc.`` and friends is kept.

Normalised output contains no digits and none of the symbols above, so
normalising twice changes nothing.

Other languages: with ``num2words`` support for the language (de, fr, es,
ru, ja, ko, …), standalone integers are spelled (``-5`` with a minus sign
too); numbers glued to ``.`` ``,`` ``:`` ``/`` and another digit (decimals,
times, dates) are left alone, since their reading is language-specific.
Chinese (``zh``) gets a small built-in speller: integers, decimals (点),
percentages (百分之), negatives (负), 4-digit years before 年 digit by
digit, and 两 for a bare 2 before a common measure word.  Other languages
are returned unchanged.  ``language="auto"`` (or ``None``) uses English
rules, whose non-Latin-script protection leaves other scripts alone.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["normalize_text", "cardinal", "ordinal", "year_words", "SUPPORTED_LANGUAGES"]

# --------------------------------------------------------------------------- number words


@lru_cache(maxsize=1)
def _n2w():
    from num2words import num2words

    return num2words


def _american(s: str) -> str:
    s = s.replace(",", "")
    s = re.sub(r"\band\b ", "", s)
    return re.sub(r"\s+", " ", s).strip()


# Cached: a 10,000-character text can hold thousands of numbers, and num2words takes tens of
# microseconds a call. ``typed``: ``1.0`` must not share ``1``'s entry.
@lru_cache(maxsize=4096, typed=True)
def cardinal(n: int) -> str:
    """``-1234`` → ``minus one thousand two hundred thirty-four``."""
    if n < 0:
        return "minus " + cardinal(-n)
    return _american(_n2w()(n, lang="en"))


@lru_cache(maxsize=4096, typed=True)
def ordinal(n: int) -> str:
    """``22`` → ``twenty-second``."""
    return _american(_n2w()(n, lang="en", to="ordinal"))


_DIGIT_WORDS = "zero one two three four five six seven eight nine".split()


def digits(s: str) -> str:
    return " ".join(_DIGIT_WORDS[int(c)] for c in s if c.isdigit())


def year_words(y: int) -> str:
    """``1999`` → nineteen ninety-nine, ``2005`` → two thousand five,
    ``2024`` → twenty twenty-four, ``1900`` → nineteen hundred, ``1905`` →
    nineteen oh five, ``2000`` → two thousand."""
    if y < 0:
        return "minus " + year_words(-y)
    if y < 1000 or y >= 10000:
        return cardinal(y)
    if 2000 <= y <= 2009 or y % 1000 == 0:
        return cardinal(y)
    hi, lo = divmod(y, 100)
    if lo == 0:
        return f"{cardinal(hi)} hundred"
    if lo < 10:
        return f"{cardinal(hi)} oh {cardinal(lo)}"
    return f"{cardinal(hi)} {cardinal(lo)}"


def _plural_word(phrase: str) -> str:
    """Pluralise the last word of a number phrase: ninety → nineties."""
    head, _, last = phrase.rpartition(" ")
    if "-" in last:
        a, _, b = last.rpartition("-")
        last = a + "-" + _plural_word(b)
    elif last.endswith("y"):
        last = last[:-1] + "ies"
    elif last == "six":
        last = "sixes"
    else:
        last += "s"
    return f"{head} {last}" if head else last


# Digit runs longer than this are read digit by digit, never as one number: num2words refuses
# values past 10**306 and int() strings past 4300 digits.
MAX_NUMBER_DIGITS = 15


def _too_long(*toks: str) -> bool:
    """Whether any of these digit strings (``,`` and a leading ``-`` allowed) is too long to read
    as one number (:data:`MAX_NUMBER_DIGITS`)."""
    return any(len(t.replace(",", "").lstrip("-")) > MAX_NUMBER_DIGITS for t in toks)


def number_words(tok: str) -> str:
    """Any numeric token: ``1,234.5``, ``-3.14``, ``.5``, ``007``, ``42``."""
    tok = tok.strip()
    neg = tok.startswith("-")
    if neg:
        tok = tok[1:]
    tok = tok.replace(",", "")
    whole, dot, frac = tok.partition(".")
    if whole and (len(whole) > MAX_NUMBER_DIGITS or (len(whole) > 1 and whole[0] == "0")):
        out = digits(whole)
    elif whole:
        out = cardinal(int(whole))
    else:
        out = ""
    if dot and frac:
        out = (out + " " if out else "") + "point " + digits(frac)
    return ("minus " + out) if neg else out


def _is_one(tok: str) -> bool:
    return tok.replace(",", "").lstrip("-") == "1"


# --------------------------------------------------------------------------- tables

_MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]  # fmt: skip
_MONTH_ABBR = {m[:3]: m for m in _MONTHS} | {"Sept": "September"}
_MONTH_RE = r"(?:" + "|".join(_MONTHS) + r"|(?:Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\.?)"


def _month_name(s: str) -> str:
    s = s.rstrip(".")
    return _MONTH_ABBR.get(s, s)


# symbol → (singular, plural, subunit singular, subunit plural)
_CURRENCY = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", None, None),
    "₹": ("rupee", "rupees", "paisa", "paise"),
    "₩": ("won", "won", None, None),
    "USD": ("US dollar", "US dollars", "cent", "cents"),
    "EUR": ("euro", "euros", "cent", "cents"),
    "GBP": ("pound", "pounds", "penny", "pence"),
    "JPY": ("yen", "yen", None, None),
    "CNY": ("yuan", "yuan", None, None),
    "RMB": ("yuan", "yuan", None, None),
    "INR": ("rupee", "rupees", "paisa", "paise"),
}
_SCALES = {
    "thousand": "thousand", "million": "million", "billion": "billion", "trillion": "trillion",
    "k": "thousand", "K": "thousand", "m": "million", "M": "million", "mn": "million",
    "b": "billion", "B": "billion", "bn": "billion", "T": "trillion", "tn": "trillion",
}  # fmt: skip

# unit → (singular, plural); matched case-sensitively after a number.
_UNITS = {
    "km": ("kilometer", "kilometers"), "m": ("meter", "meters"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "µm": ("micrometer", "micrometers"), "nm": ("nanometer", "nanometers"),
    "mi": ("mile", "miles"), "ft": ("foot", "feet"), "yd": ("yard", "yards"),
    "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"), "mg": ("milligram", "milligrams"),
    "µg": ("microgram", "micrograms"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"), "L": ("liter", "liters"), "l": ("liter", "liters"),
    "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"), "gal": ("gallon", "gallons"),
    "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
    "mph": ("mile per hour", "miles per hour"), "m/s": ("meter per second", "meters per second"),
    "°C": ("degree Celsius", "degrees Celsius"), "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "° C": ("degree Celsius", "degrees Celsius"), "° F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
    "Hz": ("hertz", "hertz"), "kHz": ("kilohertz", "kilohertz"), "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"),
    "B": ("byte", "bytes"), "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"),
    "MB": ("megabyte", "megabytes"), "GB": ("gigabyte", "gigabytes"), "TB": ("terabyte", "terabytes"),
    "PB": ("petabyte", "petabytes"), "Kb": ("kilobit", "kilobits"), "Mb": ("megabit", "megabits"),
    "Gb": ("gigabit", "gigabits"), "kbps": ("kilobit per second", "kilobits per second"),
    "Kbps": ("kilobit per second", "kilobits per second"), "Mbps": ("megabit per second", "megabits per second"),
    "Gbps": ("gigabit per second", "gigabits per second"),
    "ms": ("millisecond", "milliseconds"), "µs": ("microsecond", "microseconds"),
    "ns": ("nanosecond", "nanoseconds"), "s": ("second", "seconds"), "sec": ("second", "seconds"), "secs": ("second", "seconds"),
    "min": ("minute", "minutes"), "mins": ("minute", "minutes"), "h": ("hour", "hours"),
    "hr": ("hour", "hours"), "hrs": ("hour", "hours"), "yr": ("year", "years"), "yrs": ("year", "years"),
    "W": ("watt", "watts"), "kW": ("kilowatt", "kilowatts"), "MW": ("megawatt", "megawatts"),
    "kWh": ("kilowatt hour", "kilowatt hours"), "V": ("volt", "volts"), "mAh": ("milliamp hour", "milliamp hours"),
    "dB": ("decibel", "decibels"), "px": ("pixel", "pixels"), "fps": ("frame per second", "frames per second"),
    "rpm": ("revolution per minute", "revolutions per minute"),
    "m²": ("square meter", "square meters"), "km²": ("square kilometer", "square kilometers"),
    "ft²": ("square foot", "square feet"), "sq ft": ("square foot", "square feet"),
    "m³": ("cubic meter", "cubic meters"), "cm³": ("cubic centimeter", "cubic centimeters"),
}  # fmt: skip

# Too ambiguous with a space ("Plan 5 B", "Route 5 W"): only "5W", "5V", "5h" …
_ATTACHED_ONLY_UNITS = {"B", "W", "V", "h", "l"}
# ... and "5s" is more often "fives" than seconds: "s" only with a space ("9.58 s").
_SPACED_ONLY_UNITS = {"s"}

# Words before a 4-digit number that make it a year or a count (see _sub_year).
_STRONG_YEAR_CUES = {
    "in", "since", "until", "till", "til", "during", "circa", "ca", "c", "year", "born", "died",
    "founded", "established", "est", "fiscal", "fy", "class", "vintage", "spring", "summer",
    "autumn", "fall", "winter", "early", "mid", "late", "christmas", "easter",
    "s",  # a possessive: "Apple's 2023 revenue"
} | {m.lower() for m in _MONTHS}  # fmt: skip
_COUNT_CUES = {
    "about", "over", "nearly", "almost", "approximately", "exactly", "some", "only", "just", "than",
    "total", "all", "another", "additional", "extra", "with", "had", "has", "have", "paid",
    "cost", "costs", "costing", "page", "pages", "room", "number", "step", "item", "apartment",
    "flight", "route", "bus", "highway", "model", "least", "most", "top", "first", "last", "next",
    "these", "those", "plus", "minus", "times", "score", "scored", "earned", "won", "lost", "around",
}  # fmt: skip
# Lower-case words that commonly follow a year (so they don't make it a count).
_AFTER_YEAR_OK = {
    "and", "or", "to", "was", "is", "were", "are", "will", "would", "when", "as", "in", "on", "at",
    "the", "a", "an", "with", "for", "by", "but", "that", "which", "who", "where", "had", "has",
    "have", "it", "he", "she", "they", "we", "i", "you", "this", "there", "onwards", "onward",
    "through", "until", "till", "saw", "brought", "marked", "vs", "versus", "season",
    "election", "edition", "model", "census", "olympics", "world", "because", "after", "before",
    "if", "so", "then", "while", "ad", "bc", "bce", "ce", "alone", "again", "also", "too",
}  # fmt: skip

# --------------------------------------------------------------------------- regexes

# Linear time: every rule must take time linear in its input (the server accepts 10,000-character
# texts, and a rule that rescans a long run from each of its characters takes seconds on one).
# Hence the "(?<!\d)" lookbehinds that start the scan of a digit run at its first digit only, and
# _NOT_MID_GROUP: a "1,234,567" group chain is not rescanned from each of its inner groups (a
# chain read from an inner ",ddd,ddd," group can be read from the group before it too, which the
# search tried first, so this changes no match). Tests check each guard against the pattern
# without it, and long runs against a time bound.
_NOT_MID_GROUP = r"(?!(?<=,\d{3},)\d{3},)"
NUM = r"(?:" + _NOT_MID_GROUP + r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_RANGE_SEP = r"(?:\s?[-–]\s?|\s+to\s+)"
_TAG_RE = re.compile(
    r"<\|[^|<>\n]*\|>"  # <|speaker:0|> and other special tokens
    r"|\[[^\[\]\n]*\]"  # [laughing], [whispers softly]
)
# a letter of a non-Latin script (not µ, ², ½ …)
_NON_LATIN_LETTER_RE = re.compile(
    r"[^\W\d_A-Za-z\u00C0-\u024F\u1E00-\u1EFF\u00AA\u00B2\u00B3\u00B5\u00B9\u00BA\u00BC-\u00BE\u2150-\u215F]"
)
# What English normalisation leaves alone: tags, and every whitespace-delimited token with a
# letter of a non-Latin script. The spans are found by _protected_spans (this pattern's matches in
# linear time: the pattern itself rescans a long token from each of its characters).
_PROTECT_RE = re.compile(_TAG_RE.pattern + r"|\S*" + _NON_LATIN_LETTER_RE.pattern + r"\S*")
_TOKEN_REST_RE = re.compile(r"\S*")

_PHONE_RE = re.compile(r"(?<![\w+-])(?:\((\d{3})\)\s?|(\d{3})[-.])(\d{3})[-.](\d{4})(?![\w-])|(?<![\w-])(\d{3})-(\d{4})(?![\w-])")
_ISO_DATE_RE = re.compile(r"(?<![\w-])(\d{4})-(\d{1,2})-(\d{1,2})(?![\w-])")
_SLASH_DATE_RE = re.compile(r"(?<![\w/])(\d{1,2})/(\d{1,2})/(\d{4}|\d{2})(?![\w/])")
_MONTH_DAY_RE = re.compile(
    r"\b(" + _MONTH_RE + r")\s+(\d{1,2})(?:st|nd|rd|th)?(?![\w:])(?:(,?\s+)(\d{4})(?!\w))?"
)
_DAY_MONTH_RE = re.compile(
    r"(?<![\w.,])(?:(the|The)\s+)?(\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?(" + "|".join(_MONTHS) + r")\b(?:(,?\s+)(\d{4})(?!\w))?"
)
_AMPM = r"([AaPp])(?:\.\s?[Mm]\.|\s?[Mm]\b)"
_TIME_RE = re.compile(r"(?<![\w:.])([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?(?:\s?" + _AMPM + r")?(?![\w:])")
_HOUR_AMPM_RE = re.compile(r"(?<![\w:.])(1[0-2]|0?[1-9])\s?" + _AMPM + r"(?!\w)")
_CUR_SYMS = r"[$€£¥₹₩]"
_CUR_CODES = r"(?:USD|EUR|GBP|JPY|CNY|RMB|INR)"
_SCALE_RE = r"(?:\s?(?:thousand|million|billion|trillion)\b|(?:k|K|m|M|mn|b|B|bn|T|tn)(?![\w]))"
_CURRENCY_PRE_RE = re.compile(
    r"(?<![\w.])(-)?(" + _CUR_SYMS + r"|" + _CUR_CODES + r"\s?)(" + NUM + r")(" + _SCALE_RE + r")?"
    r"(?:" + _RANGE_SEP + r"(?:" + _CUR_SYMS + r")?(" + NUM + r")(" + _SCALE_RE + r")?)?(?![\d])"
)
_CURRENCY_POST_RE = re.compile(
    r"(?<![\w.,])(-)?(" + NUM + r")(?:" + _RANGE_SEP + r"(" + NUM + r"))?\s?(" + _CUR_SYMS + r"|" + _CUR_CODES + r"\b)"
)
_PERCENT_RE = re.compile(r"(?<![\w.,])(-?" + NUM + r")(?:" + _RANGE_SEP + r"(-?" + NUM + r"))?\s?%")
_DECADE_FULL_RE = re.compile(r"(?<![\w'])(1\d|20)(\d)0s\b")
_DECADE_SHORT_RE = re.compile(r"(?<![\w])['’]?([1-9])0s\b")
_ORDINAL_RE = re.compile(r"(?<![\w.])(" + _NOT_MID_GROUP + r"\d{1,3}(?:,\d{3})+|\d+)(st|nd|rd|th)\b")
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_UNIT_RE = re.compile(
    r"(?<![\w.,])(-?" + NUM + r")(?:" + _RANGE_SEP + r"(-?" + NUM + r"))?\s?(" + _UNIT_ALT + r")(?![\w²³/])"
)
_DIMENSION_RE = re.compile(r"(?<![\w.])(" + NUM + r")(?:x|×|\sx\s)(" + NUM + r")(?![\w.])")
_RATIO_RE = re.compile(r"(?<![\w:.])(\d+):(\d+)(?![\w:]|[.,]\d)")
_TIMES_RE = re.compile(r"(?<![\w.])(" + NUM + r")x(?!\w)")
_UNICODE_FRACTIONS = {"½": (1, 2), "¼": (1, 4), "¾": (3, 4), "⅓": (1, 3), "⅔": (2, 3), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8), "⅞": (7, 8)}
_UFRAC_RE = re.compile(r"(?:(?<!\d)(\d+)\s?)?([" + "".join(_UNICODE_FRACTIONS) + r"])")
_MIXED_FRAC_RE = re.compile(r"(?<![\w.,/])(\d+)\s+(\d+)/(\d+)(?![\w/])")
_FRACTION_RE = re.compile(r"(?<![\w.,/])(\d+)/(\d+)(?![\w/]|[.,]\d)")
_RANGE_RE = re.compile(r"(?<![\w.,-])(" + NUM + r")(?:-|\s?–\s?)(" + NUM + r")(?![\w]|[.,]\d|-\d)")
_NEG_RE = re.compile(r"(?:^|(?<=[\s(\[{=:;,/]))-(" + NUM + r")(?![\w])")
_ROUND_PLURAL_RE = re.compile(r"(?<![\w.,])(100|1000|1,000|1000000|1,000,000) s\b")
_YEAR_RE = re.compile(r"(?<![\w.,$€£¥-])(\d{4})(?![\w]|[.,]\d)")
_DOTTED_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w]|\.\d)")
_LETTER_DIGIT_RE = re.compile(r"(?<=[A-Za-z])-?(?=\d)|(?<=\d)(?=[A-Za-z])")
_NUMBER_RE = re.compile(r"(?<![\w])" + NUM + r"(?![\w])")
_EMAIL_RE = re.compile(r"\b([\w.+-]+)@([\w-]+(?:\.[\w-]+)+)\b")  # applied by _sub_emails
_EMAIL_START_RE = re.compile(r"\b[\w.+-]")
_EMAIL_RUN_RE = re.compile(r"[\w.+-]+")

# Abbreviations: (pattern, replacement, keeps a sentence-final period).
# ``replacement`` may be a function (match → str) for context-dependent ones.
_CAP_NEXT = r"(?=\s+[A-Z])"


_ASCII_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NEXT_CAPITALIZED_RE = re.compile(r"\s+[A-Z]")


def _prev_word_capitalized(m: re.Match) -> bool:
    """The ``[A-Za-z0-9]`` run just before the match (past any whitespace) starts with a capital
    or a digit. Walks back from the match rather than searching the whole text before it, which
    took time quadratic in the text's length over all matches."""
    s, i = m.string, m.start()
    while i > 0 and s[i - 1].isspace():
        i -= 1
    j = i
    while j > 0 and s[j - 1] in _ASCII_ALNUM:
        j -= 1
    return j < i and (s[j].isupper() or s[j].isdigit())


def _next_word_capitalized(m: re.Match) -> bool:
    return bool(_NEXT_CAPITALIZED_RE.match(m.string, m.end()))


def _saint_or_street(m: re.Match) -> str:
    if _next_word_capitalized(m) and not _prev_word_capitalized(m):
        return "Saint"
    return "Street" if _prev_word_capitalized(m) else "Saint"


def _doctor_or_drive(m: re.Match) -> str:
    if _next_word_capitalized(m) or not _prev_word_capitalized(m):
        return "Doctor"
    return "Drive"


_TITLES = {
    "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor", "Rev": "Reverend",
    "Gen": "General", "Capt": "Captain", "Lt": "Lieutenant", "Sgt": "Sergeant", "Col": "Colonel",
    "Gov": "Governor", "Sen": "Senator", "Rep": "Representative", "Pres": "President",
    "Mt": "Mount", "Ft": "Fort",
}  # fmt: skip
_ABBREVIATIONS: list[tuple[re.Pattern, object, bool]] = [
    # titles before a capitalised name; Mr/Mrs/Ms also without the period (British style)
    (re.compile(r"\b(Mrs|Mr|Ms)\.?" + _CAP_NEXT), lambda m: _TITLES[m.group(1)], False),
    (re.compile(r"\b(" + "|".join(_TITLES) + r")\." + _CAP_NEXT), lambda m: _TITLES[m.group(1)], False),
    (re.compile(r"\bDr\.(?=\s|$)|\bDr(?=\s+[A-Z])"), _doctor_or_drive, True),
    (re.compile(r"\bSt\.(?=\s|$)"), _saint_or_street, True),
    (re.compile(r"(?<=[A-Za-z]),?\s(Jr|Sr)\.", ), lambda m: " " + {"Jr": "Junior", "Sr": "Senior"}[m.group(1)], True),
    (re.compile(r"(?<=[A-Za-z]\s)Ave\."), "Avenue", True),
    (re.compile(r"(?<=[A-Za-z]\s)Blvd\."), "Boulevard", True),
    (re.compile(r"(?<=[A-Za-z]\s)Rd\."), "Road", True),
    (re.compile(r"\b[Vv]s\.?(?=\s)"), "versus", False),
    (re.compile(r"\betc\."), "et cetera", True),
    (re.compile(r"(?<![\w.])[Ee]\.g\.(?!\w)"), "for example", False),
    (re.compile(r"(?<![\w.])[Ii]\.e\.(?!\w)"), "that is", False),
    (re.compile(r"(?<![\w.])[Aa]\.k\.a\.?(?!\w)|\baka\b"), "also known as", False),
    (re.compile(r"\b[Aa]pprox\."), "approximately", False),
    (re.compile(r"\b[Ii]ncl\."), "including", False),
    (re.compile(r"\bInc\."), "Incorporated", True),
    (re.compile(r"\bLtd\."), "Limited", True),
    (re.compile(r"\bCorp\."), "Corporation", True),
    (re.compile(r"\bDept\."), "Department", True),
    (re.compile(r"\b[Nn]o\.(?=\s?\d)"), "number", False),
    (re.compile(r"\bw/o(?=\s)"), "without", False),
    (re.compile(r"\bw/(?=\s)"), "with", False),
]

# --------------------------------------------------------------------------- rule functions


def _plural_unit(tok: str, unit: tuple[str, str], ranged: bool = False) -> str:
    return unit[0] if (not ranged and _is_one(tok)) else unit[1]


def _sub_phone(m: re.Match) -> str:
    if m.group(5):
        return f"{digits(m.group(5))}, {digits(m.group(6))}"
    area = m.group(1) or m.group(2)
    return f"{digits(area)}, {digits(m.group(3))}, {digits(m.group(4))}"


def _date_words(year: int | None, month: int, day: int) -> str:
    s = f"{_MONTHS[month - 1]} {ordinal(day)}"
    return f"{s}, {year_words(year)}" if year is not None else s


def _sub_iso_date(m: re.Match) -> str:
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return m.group(0)
    return _date_words(y, mo, d)


def _sub_slash_date(m: re.Match) -> str:
    a, b, ys = int(m.group(1)), int(m.group(2)), m.group(3)
    if 1 <= a <= 12 and 1 <= b <= 31:
        mo, d = a, b
    elif 1 <= b <= 12 and 1 <= a <= 31:
        mo, d = b, a
    else:
        return m.group(0)
    y = int(ys)
    if len(ys) == 2:
        y += 2000 if y < 50 else 1900
    return _date_words(y, mo, d)


def _sub_month_day(m: re.Match) -> str:
    month, day = _month_name(m.group(1)), int(m.group(2))
    if not 1 <= day <= 31:
        return m.group(0)
    s = f"{month} {ordinal(day)}"
    if m.group(4):
        s += f", {year_words(int(m.group(4)))}"
    return s


def _sub_day_month(m: re.Match) -> str:
    day = int(m.group(2))
    if not 1 <= day <= 31:
        return m.group(0)
    the = m.group(1) or "the"
    s = f"{the} {ordinal(day)} of {m.group(3)}"
    if m.group(5):
        s += f", {year_words(int(m.group(5)))}"
    return s


def _time_words(h: int, mi: int, sec: str | None, ampm: str | None) -> str:
    if ampm:
        suffix = " " + ampm.upper() + "M"
        hh = h if h <= 12 else h - 12
        hh = 12 if hh == 0 else hh
        if mi == 0:
            s = cardinal(hh)
        elif mi < 10:
            s = f"{cardinal(hh)} oh {cardinal(mi)}"
        else:
            s = f"{cardinal(hh)} {cardinal(mi)}"
        s += suffix
    else:
        if mi == 0:
            s = f"{cardinal(h)} o'clock" if 1 <= h <= 12 else f"{cardinal(h)} hundred"
        elif mi < 10:
            s = f"{cardinal(h)} oh {cardinal(mi)}"
        else:
            s = f"{cardinal(h)} {cardinal(mi)}"
    if sec is not None and int(sec):
        n = int(sec)
        s += f" and {cardinal(n)} second{'s' if n != 1 else ''}"
    return s


def _ampm_period(m: re.Match) -> str:
    """Give back the sentence period that a final ``p.m.`` swallowed."""
    return "." if m.group(0).endswith(".") and _sentence_end_after(m) else ""


def _sub_time(m: re.Match) -> str:
    return _time_words(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)) + _ampm_period(m)


def _sub_hour_ampm(m: re.Match) -> str:
    return _time_words(int(m.group(1)), 0, None, m.group(2)) + _ampm_period(m)


def _money_words(tok: str, cur: tuple, scale: str | None) -> str:
    one, many, sub1, subn = cur
    clean = tok.replace(",", "")
    if scale:
        return f"{number_words(clean)} {_SCALES[scale.strip()]} {many}"
    whole, _, frac = clean.partition(".")
    if _too_long(whole):
        return f"{number_words(clean)} {many}"
    if frac and len(frac) == 2 and sub1:
        w = int(whole or 0)
        c = int(frac)
        parts = []
        if w:
            parts.append(f"{cardinal(w)} {one if w == 1 else many}")
        if c or not w:
            parts.append(f"{cardinal(c)} {sub1 if c == 1 else subn}")
        return " and ".join(parts)
    if not frac and int(whole or 0) == 1:
        return f"one {one}"
    return f"{number_words(clean)} {many}"


def _sub_currency_pre(m: re.Match) -> str:
    neg, sym, a, sa, b, sb = m.groups()
    cur = _CURRENCY[sym.strip()]
    if b is not None:
        left = number_words(a) + (f" {_SCALES[sa.strip()]}" if sa else "")
        s = f"{left} to {_money_words(b, cur, sb)}"
    else:
        s = _money_words(a, cur, sa)
    return ("minus " if neg else "") + s


def _sub_currency_post(m: re.Match) -> str:
    neg, a, b, sym = m.groups()
    cur = _CURRENCY[sym.strip()]
    s = f"{number_words(a)} to {_money_words(b, cur, None)}" if b else _money_words(a, cur, None)
    return ("minus " if neg else "") + s


def _sub_percent(m: re.Match) -> str:
    a, b = m.group(1), m.group(2)
    if b:
        return f"{number_words(a)} to {number_words(b)} percent"
    return f"{number_words(a)} percent"


def _sub_decade_full(m: re.Match) -> str:
    y = int(m.group(1) + m.group(2) + "0")
    return _plural_word(year_words(y))


def _sub_decade_short(m: re.Match) -> str:
    return _plural_word(cardinal(int(m.group(1)) * 10))


def _sub_ordinal(m: re.Match) -> str:
    if _too_long(m.group(1)):
        return number_words(m.group(1))
    return ordinal(int(m.group(1).replace(",", "")))


def _sub_unit(m: re.Match) -> str:
    a, b, u = m.group(1), m.group(2), m.group(3)
    spaced = m.group(0)[m.start(3) - m.start() - 1].isspace()
    if (u in _ATTACHED_ONLY_UNITS and spaced) or (u in _SPACED_ONLY_UNITS and not spaced):
        return m.group(0)
    unit = _UNITS[u]
    if b:
        return f"{number_words(a)} to {number_words(b)} {unit[1]}"
    return f"{number_words(a)} {_plural_unit(a, unit)}"


def _fraction_words(num: int, den: int) -> str | None:
    if den == 0 or num == 0:
        return None
    if not (num < den or (num <= 20 and den <= 10 and num != den)):
        return None
    if den == 2:
        denom = "half" if num == 1 else "halves"
    elif den == 4:
        denom = "quarter" if num == 1 else "quarters"
    else:
        o = ordinal(den)
        denom = o if num == 1 else o + "s"
    return f"{cardinal(num)} {denom}"


def _sub_fraction(m: re.Match) -> str:
    a, b = m.group(1), m.group(2)
    f = None if _too_long(a, b) else _fraction_words(int(a), int(b))
    return f if f else f"{number_words(a)} {number_words(b)}"


def _sub_mixed_fraction(m: re.Match) -> str:
    if _too_long(m.group(2), m.group(3)):
        return m.group(0)  # the plain fraction rule reads it
    f = _fraction_words(int(m.group(2)), int(m.group(3)))
    if f is None or int(m.group(2)) >= int(m.group(3)):
        return m.group(0)
    return f"{number_words(m.group(1))} and {f}"


def _sub_unicode_fraction(m: re.Match) -> str:
    num, den = _UNICODE_FRACTIONS[m.group(2)]
    f = _fraction_words(num, den)
    if m.group(1):
        return f"{number_words(m.group(1))} and {f}"
    return f


def _yearish(tok: str) -> bool:
    return len(tok) == 4 and tok.isdigit() and 1000 <= int(tok) <= 2099


def _sub_range(m: re.Match) -> str:
    a, b = m.group(1), m.group(2)
    if _yearish(a) and (_yearish(b) or (len(b) == 2 and b.isdigit())):
        right = year_words(int(b)) if len(b) == 4 else cardinal(int(b))
        return f"{year_words(int(a))} to {right}"
    return f"{number_words(a)} to {number_words(b)}"


def _sub_neg(m: re.Match) -> str:
    return "minus " + number_words(m.group(1))


_WORD_BEFORE_RE = re.compile(r"([A-Za-z]+)\.?,?\s+$")  # "Apple's" → "s"
_WORD_AFTER_RE = re.compile(r"^\s+([A-Za-z]+)")


def _sub_year(m: re.Match) -> str:
    tok = m.group(1)
    n = int(tok)
    if tok[0] == "0":
        return digits(tok)
    s = m.string
    before = _WORD_BEFORE_RE.search(s[max(0, m.start() - 40) : m.start()])
    after = _WORD_AFTER_RE.search(s[m.end() : m.end() + 40])
    prev = before.group(1).lower() if before else ""
    nxt = after.group(1) if after else ""
    if nxt.upper() in ("AD", "BC", "BCE", "CE") and 1 <= n:
        return year_words(n)
    if not 1000 <= n <= 2099:
        return cardinal(n)
    if prev in _STRONG_YEAR_CUES:
        return year_words(n)
    if prev in _COUNT_CUES:
        return cardinal(n)
    if nxt and nxt[0].islower() and nxt.lower() not in _AFTER_YEAR_OK:
        return cardinal(n)
    return year_words(n)


def _sub_round_plural(m: re.Match) -> str:
    return {"100": "hundreds", "1000": "thousands", "1000000": "millions"}[m.group(1).replace(",", "")]


def _sub_dotted(m: re.Match) -> str:
    parts = m.group(0).split(".")
    if len(parts) == 4 and all(len(p) <= 3 and int(p) <= 255 for p in parts):  # IPv4 address
        return " dot ".join(digits(p) for p in parts)
    return " point ".join(number_words(p) for p in parts)


def _sub_number(m: re.Match) -> str:
    return number_words(m.group(0))


def _sub_email(m: re.Match) -> str:
    user = m.group(1).replace(".", " dot ")
    dom = m.group(2).replace(".", " dot ")
    return f"{user} at {dom}"


_BLANK_TO_END_RE = re.compile(r"\s*\Z")


def _sentence_end_after(m: re.Match) -> bool:
    """The abbreviation's period also ends the sentence (end of text, or a
    capitalised word follows)."""
    return bool(_BLANK_TO_END_RE.match(m.string, m.end())) or _next_word_capitalized(m)


def _sub_abbrev(pat: re.Pattern, repl, keep_period: bool, s: str) -> str:
    def f(m: re.Match) -> str:
        out = repl(m) if callable(repl) else repl
        if keep_period and m.group(0).endswith(".") and _sentence_end_after(m):
            if not (out in ("Doctor", "Saint") and _next_word_capitalized(m)):
                out += "."
        return out

    return pat.sub(f, s)


def _sub_emails(s: str) -> str:
    """``_EMAIL_RE.sub(_sub_email, s)`` in linear time.

    The pattern alone rescans a long ``[\\w.+-]`` run (``1-1-1-…``, ``a.b.c.…``) from each word
    boundary in it. But a match starting at a word boundary in such a run takes the rest of the
    run, so it matches from there if and only if it matches from the run's first word boundary
    that the search reaches: one try per run gives the same matches."""
    if "@" not in s:
        return s
    out, last, pos = [], 0, 0
    while (start := _EMAIL_START_RE.search(s, pos)) is not None:
        m = _EMAIL_RE.match(s, start.start())
        if m:
            out += [s[last : m.start()], _sub_email(m)]
            last = pos = m.end()
        else:
            pos = _EMAIL_RUN_RE.match(s, start.start()).end()
    out.append(s[last:])
    return "".join(out)


# "\s*X\s*" rescans a long run of whitespace from each of its characters; a match starts at the
# run's first character (or at X itself, right after an earlier match's trailing whitespace), so
# "(?<!\s)\s*X\s*|X\s*" finds the same matches in linear time.
def _spaced(sym: str) -> str:
    return rf"(?<!\s)\s*{sym}\s*|{sym}\s*"


# "\s*=\s*" (not after = < > !, not before = >) starts at a run's first whitespace, at its second
# (after = < > !), or at the last one before "=" (after an earlier match that stopped short of "==").
_EQUALS_RE = re.compile(r"(?<![=<>!])(?:(?<![\s=<>!])|(?<=[=<>!]\s)|(?=\s=))\s*=\s*(?![=>])")
_PERCENT_SIGN_RE = re.compile(r"(?<!\s)\s*%")  # "\s*%"


def _symbols(s: str) -> str:
    s = _sub_emails(s)
    s = re.sub(r"\b([CF])#(?!\w)", r"\1 sharp", s)
    s = re.sub(r"#\s?(?=\d)", " number ", s)
    s = re.sub(r"#(?=[A-Za-z])", " hashtag ", s)
    s = re.sub(_spaced("&"), " and ", s)
    s = re.sub(_spaced("±"), " plus or minus ", s)
    s = re.sub(_spaced(r"\+"), " plus ", s)
    s = _EQUALS_RE.sub(" equals ", s)
    s = re.sub(_spaced("@"), " at ", s)
    s = re.sub(_spaced("×"), " times ", s)
    s = re.sub(_spaced("÷"), " divided by ", s)
    s = re.sub(r"~\s?(?=\d)", "about ", s)
    s = re.sub(_spaced("≈"), " approximately ", s)
    s = _PERCENT_SIGN_RE.sub(" percent", s)
    return s


# --------------------------------------------------------------------------- English pipeline


def _normalize_en_segment(s: str) -> str:
    core = s.strip()
    if not core:
        return s
    lead = s[: len(s) - len(s.lstrip())]
    trail = s[len(s.rstrip()) :]
    s = core.replace("\u2212", "-").replace("\u00a0", " ").replace("\u202f", " ")
    s = re.sub(r"(?<=\d)\s?[–—]\s?(?=[\d$€£¥])", "-", s)

    for pat, repl, keep in _ABBREVIATIONS:
        s = _sub_abbrev(pat, repl, keep, s)
    s = re.sub(r"#\s?(?=\d)", "number ", s)
    s = re.sub(r"~\s?(?=[\d$€£¥₹₩.])", "about ", s)

    s = _PHONE_RE.sub(_sub_phone, s)
    s = _ISO_DATE_RE.sub(_sub_iso_date, s)
    s = _SLASH_DATE_RE.sub(_sub_slash_date, s)
    s = _MONTH_DAY_RE.sub(_sub_month_day, s)
    s = _DAY_MONTH_RE.sub(_sub_day_month, s)
    s = _TIME_RE.sub(_sub_time, s)
    s = _HOUR_AMPM_RE.sub(_sub_hour_ampm, s)
    s = _CURRENCY_PRE_RE.sub(_sub_currency_pre, s)
    s = _CURRENCY_POST_RE.sub(_sub_currency_post, s)
    s = _PERCENT_RE.sub(_sub_percent, s)
    s = _DECADE_FULL_RE.sub(_sub_decade_full, s)
    s = _DECADE_SHORT_RE.sub(_sub_decade_short, s)
    s = _ORDINAL_RE.sub(_sub_ordinal, s)
    s = _UFRAC_RE.sub(_sub_unicode_fraction, s)
    s = _UNIT_RE.sub(_sub_unit, s)
    s = _DIMENSION_RE.sub(lambda m: f"{number_words(m.group(1))} by {number_words(m.group(2))}", s)
    s = _TIMES_RE.sub(lambda m: f"{number_words(m.group(1))} times", s)
    s = _RATIO_RE.sub(lambda m: f"{number_words(m.group(1))} to {number_words(m.group(2))}", s)
    s = _MIXED_FRAC_RE.sub(_sub_mixed_fraction, s)
    s = _FRACTION_RE.sub(_sub_fraction, s)
    s = _RANGE_RE.sub(_sub_range, s)
    s = _NEG_RE.sub(_sub_neg, s)
    s = _LETTER_DIGIT_RE.sub(" ", s)
    s = _ROUND_PLURAL_RE.sub(_sub_round_plural, s)
    s = _YEAR_RE.sub(_sub_year, s)
    s = _DOTTED_RE.sub(_sub_dotted, s)
    s = _NUMBER_RE.sub(_sub_number, s)
    s = _symbols(s)
    for pat, repl, keep in _ABBREVIATIONS:  # again: splitting digits off letters exposes new ones
        s = _sub_abbrev(pat, repl, keep, s)

    s = re.sub(r"[ \t]{2,}", " ", s)
    s = re.sub(r"(?<=\w) +([,.;:!?])(?=\s|$)", r"\1", s)
    return lead + s.strip() + trail


# --------------------------------------------------------------------------- other languages

_PLAIN_INT_RE = re.compile(r"(?<![\d.,:/\w-])(-)?(\d+)(?![\d]|[.,:/]\d)")
_PLAIN_INT_ANY_RE = re.compile(r"(?<![\d.,:/-])(-)?(\d+)(?![\d]|[.,:/]\d)")


@lru_cache(maxsize=4096)
def _spelled(n: int, lang: str) -> str | None:
    """``num2words(n, lang=lang)``, cached (as :func:`cardinal`); None where it fails."""
    try:
        return _n2w()(n, lang=lang)
    except Exception:  # a converter without negatives etc.
        return None


def _normalize_num2words_segment(s: str, lang: str) -> str:
    def f(m: re.Match) -> str:
        tok = m.group(2)
        if len(tok) > 15 or (len(tok) > 1 and tok[0] == "0"):
            return m.group(0)
        n = int(tok) * (-1 if m.group(1) else 1)
        spelled = _spelled(n, lang)
        return m.group(0) if spelled is None else spelled

    # CJK-style languages write numbers glued to words; others separate them.
    pat = _PLAIN_INT_ANY_RE if lang in ("ja", "ko", "th") else _PLAIN_INT_RE
    return pat.sub(f, s)


_ZH_DIGITS = "零一二三四五六七八九"
_ZH_UNITS = ["", "十", "百", "千"]
_ZH_BIG = ["", "万", "亿", "兆"]
_ZH_MEASURE = "个位只条本张件次天种家台辆份双对名岁杯碗斤元块年月周"


def _zh_4(n: int) -> str:
    out, zero = "", False
    for i in range(3, -1, -1):
        d = (n // 10**i) % 10
        if d == 0:
            zero = bool(out)
            continue
        if zero:
            out += "零"
            zero = False
        out += _ZH_DIGITS[d] + _ZH_UNITS[i]
    return out


def zh_cardinal(n: int) -> str:
    """Chinese reading of an integer: 10 → 十, 105 → 一百零五, 20000 → 两万 is
    left as 二万 (both are heard), 100000000 → 一亿."""
    if n < 0:
        return "负" + zh_cardinal(-n)
    if n == 0:
        return "零"
    groups = []
    while n:
        groups.append(n % 10000)
        n //= 10000
    out, zero = "", False
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        if g == 0:
            zero = bool(out)
            continue
        if out and (zero or g < 1000):
            out += "零"
        zero = False
        out += _zh_4(g) + _ZH_BIG[i]
    if out.startswith("一十"):
        out = out[1:]
    return out


def _zh_number(tok: str) -> str:
    neg = tok.startswith("-")
    tok = tok.lstrip("-").replace(",", "")
    whole, _, frac = tok.partition(".")
    if len(whole) > 16 or (len(whole) > 1 and whole[0] == "0"):
        out = "".join(_ZH_DIGITS[int(c)] for c in whole)
    else:
        out = zh_cardinal(int(whole or 0))
    if frac:
        out += "点" + "".join(_ZH_DIGITS[int(c)] for c in frac)
    return ("负" if neg else "") + out


_ZH_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
# Linear time (see NUM): the scan of a digit run starts at its first digit only, and not at an
# inner group of a "1,234,567" chain.
_ZH_PERCENT_RE = re.compile(r"(-?(?<!\d)" + _NOT_MID_GROUP + _ZH_NUM.removeprefix("-?") + r")\s?%")


def _normalize_zh_segment(s: str) -> str:
    s = re.sub(r"(?<![\d.])(\d{4})(?=年)", lambda m: "".join(_ZH_DIGITS[int(c)] for c in m.group(1)), s)
    s = _ZH_PERCENT_RE.sub(lambda m: "百分之" + _zh_number(m.group(1)), s)
    s = re.sub(r"(?<![\d.])2(?=[" + _ZH_MEASURE + r"])", "两", s)
    s = re.sub(r"(?<![\d.])" + _ZH_NUM + r"(?![\d])", lambda m: _zh_number(m.group(0)), s)
    return s


# --------------------------------------------------------------------------- entry point


def _lang_key(language: str | None) -> str:
    if not language:
        return "auto"
    lang = language.strip().replace("-", "_")
    base = lang.split("_")[0].lower()
    if base in ("en", "auto", "zh"):
        return base
    if base == "cmn":
        return "zh"
    try:
        from num2words import CONVERTER_CLASSES
    except ImportError:  # pragma: no cover
        return ""
    for cand in (lang, lang.lower(), base + "_" + lang.split("_")[1].upper() if "_" in lang else "", base):
        if cand and cand in CONVERTER_CLASSES:
            return cand
    return ""


def _supported_languages() -> set[str]:
    try:
        from num2words import CONVERTER_CLASSES
    except ImportError:  # pragma: no cover
        return {"en"}
    return set(CONVERTER_CLASSES) | {"en", "zh"}


SUPPORTED_LANGUAGES = _supported_languages()


def _protected_spans(text: str) -> list[tuple[int, int]]:
    """The spans of ``_PROTECT_RE.finditer(text)``, in linear time.

    At each position the pattern tries a tag first, then "a whitespace-free stretch from here
    holding a non-Latin letter, to the token's end"; the latter first holds at the start of the
    token holding the next such letter, or where the search stands if that is inside the token
    (right after a tag)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    tag = _TAG_RE.search(text)
    letter = _NON_LATIN_LETTER_RE.search(text)
    token_start = -1  # where that letter's token starts (or a point at most pos before it)
    while True:
        if tag is not None and tag.start() < pos:
            tag = _TAG_RE.search(text, pos)
        if letter is not None and letter.start() < pos:
            letter = _NON_LATIN_LETTER_RE.search(text, pos)
            token_start = -1
        if letter is not None:
            if token_start < 0:
                token_start = letter.start()
                while token_start > pos and not text[token_start - 1].isspace():
                    token_start -= 1
            start = max(pos, token_start)
            if tag is None or tag.start() > start:
                pos = _TOKEN_REST_RE.match(text, letter.start()).end()
                spans.append((start, pos))
                continue
        if tag is None:
            return spans
        spans.append(tag.span())
        pos = tag.end()


def _split_protected(text: str, english: bool):
    """Yield ``(segment, protected)`` pieces in order."""
    spans = _protected_spans(text) if english else [m.span() for m in _TAG_RE.finditer(text)]
    pos = 0
    for start, end in spans:
        if start > pos:
            yield text[pos:start], False
        yield text[start:end], True
        pos = end
    if pos < len(text):
        yield text[pos:], False


def normalize_text(text: str, language: str | None = "en") -> str:
    """Spoken form of ``text`` for TTS (see the module docstring for the rules).

    ``language``: ``"en"`` (also ``en-US`` etc.), ``"auto"``/``None`` (English
    rules; other scripts are left alone), ``"zh"``, or any language
    ``num2words`` knows (plain integers only).  Unknown languages: unchanged.
    """
    if not text:
        return text
    key = _lang_key(language)
    if key in ("en", "auto"):
        fn = _normalize_en_segment
    elif key == "zh":
        fn = _normalize_zh_segment
    elif key:
        fn = lambda seg: _normalize_num2words_segment(seg, key)  # noqa: E731
    else:
        return text
    if key not in ("en", "auto") and not any(c.isdigit() for c in text):
        return text
    english = key in ("en", "auto")
    return "".join(seg if prot else fn(seg) for seg, prot in _split_protected(text, english))
