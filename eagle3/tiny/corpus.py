"""Deterministic training text for the tiny tokenizer.

The tiny tokenizer must split the prompts the pipeline sees (English questions,
code, arithmetic, chat boilerplate, reasoning chatter) into sensible pieces, yet
nothing may be downloaded. So the text is generated here from hand-written word
lists and templates, driven by one seeded ``random.Random``: the same seed gives
the same text on every machine and Python version (``random`` with an int seed
is stable across versions for the methods used here: ``random``, ``randrange``,
``choice``, ``shuffle``). Pseudo-words built from syllables widen the vocabulary
so BPE has enough distinct material to fill ~4k merges.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

NOUNS = """
time year people way day man woman child world life hand part place case week
company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher
force education model data value function list string file table query server
client request response error answer problem solution equation number variable
matrix vector graph tree node edge path loop array object class method token
message reply user assistant model training layer weight bias gradient step
river mountain forest garden kitchen window bridge market music picture letter
animal bird dog cat horse apple bread coffee tea sugar salt stone paper glass
energy light sound color shape circle square triangle angle line point plane
planet star moon sun ocean island desert village country language science
""".split()

VERBS = """
be have do say go get make know think take see come want look use find give
tell work call try ask need feel become leave put mean keep let begin seem help
talk turn start show hear play run move like live believe hold bring happen
write provide sit stand lose pay meet include continue set learn change lead
understand watch follow stop create speak read allow add spend grow open walk
win offer remember love consider appear buy wait serve die send expect build
stay fall cut reach kill remain suggest raise pass sell require report decide
pull return explain hope develop carry break receive agree support hit produce
eat cover catch draw choose compute solve check count sort merge parse load
save print train test measure compare divide multiply subtract simplify prove
""".split()

ADJECTIVES = """
good new first last long great little own other old right big high different
small large next early young important few public bad same able simple clear
full special easy strong certain free true whole real best better sure low
late hard major possible quick slow bright dark happy careful quiet empty
correct wrong exact total final average positive negative prime even odd
random sorted empty valid local global private static recursive linear
""".split()

ADVERBS = """
quickly slowly carefully clearly really simply only also just still already
often never always sometimes usually again soon today here there now then
""".split()

NAMES = """
Alice Bob Carol David Emma Frank Grace Henry Iris Jack Kate Liam Maya Noah
Olivia Peter Quinn Rosa Sam Tara Uma Victor Wendy Xavier Yara Zoe Paris London
Tokyo Berlin Cairo Lima Oslo Rome Sydney Toronto Python Rust Linux Monday
Friday January March July October
""".split()

FUNCTION_WORDS = """
the a an this that these those my your his her its our their some any every
each no all both either in on at by for with about from into over under after
before between through during without within and or but so because if when
while although than as of to is are was were will would can could should may
might must not very more most much many such what which who whom whose where
why how
""".split()

MORE_WORDS = """
hello hi thanks thank please sorry yes okay maybe because however therefore
example examples simple important different following include including
between another around without against within during before after above below
people children family friends student students teacher school university
computer software hardware internet website email phone network security
database algorithm process performance memory storage machine learning deep
neural network language models intelligence artificial question questions
history culture society economy market price cost money business customer
product design quality health medical doctor hospital patient disease
treatment food water weather climate environment energy electricity power
physics chemistry biology mathematics geometry algebra calculus statistics
probability theorem proof definition formula equation equations integer
fraction decimal percent ratio sum difference product quotient remainder
square root power exponent logarithm derivative integral limit series
sequence function functions input output argument parameter parameters
return returns value values type types error errors exception debug debugging
install version update release package library module import export config
configuration option options setting settings command commands terminal
document documents text texts sentence sentences paragraph paragraphs words
meaning describe description explain explanation summary summarize translate
translation write writing written read reading review reviews feedback
improve improvement suggest suggestions recommend recommendation plan plans
strategy goal goals project projects task tasks schedule meeting meetings
travel trip hotel flight city cities country countries world global local
music song songs movie movies book books story stories character characters
game games player players sport sports team teams win winning lose score
recipe cook cooking ingredients chicken rice pasta vegetables fruit cheese
morning afternoon evening night today tomorrow yesterday week weekend month
first second third fourth fifth next previous final last early later
understand understanding consider considering assume assuming determine
calculate calculation result results approach approaches method methods
therefore thus hence since given let suppose notice observe recall note
""".split()

SYLLABLES = """
ka lo mi ne ru sa te vo zi ba de fi go hu ja ke la mo nu pa qui re si to
va xe yo ze an el in on un ar er ir or ur ing ion est ent ous ity ive
""".split()

CHAT_OPENERS = [
    "Sure! Here is",
    "Of course. Here's",
    "Great question!",
    "Certainly.",
    "Thanks for asking.",
    "I'd be happy to help.",
    "Good point.",
    "Let me explain.",
    "Here's a short summary:",
    "In short,",
]

THOUGHTS = [
    "Okay, let me think about this step by step.",
    "Hmm, wait.",
    "Let me double-check that.",
    "So the answer should be",
    "Actually, that is not right.",
    "First, I need to understand what the user is asking.",
    "The user wants",
    "Let me verify:",
    "That seems consistent.",
    "Alternatively, we could",
    "I think the key idea is",
    "Putting it together,",
]

OPS = ["+", "-", "*", "/"]


def pseudo_word(rng: random.Random) -> str:
    # Invented words give BPE sub-word material that the small real word
    # lists alone would run out of before the target vocabulary size.
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def word(rng: random.Random) -> str:
    pool = rng.choice((NOUNS, VERBS, ADJECTIVES, MORE_WORDS, MORE_WORDS, FUNCTION_WORDS, FUNCTION_WORDS))
    return rng.choice(pool) if rng.random() < 0.98 else pseudo_word(rng)


def word_stream(rng: random.Random) -> str:
    # Function words dominate real text; this keeps their merges cheap.
    words = [word(rng) for _ in range(rng.randint(8, 40))]
    words[0] = words[0].title()
    return " ".join(words) + rng.choice((".", ".", ",", "?", "!", ":"))


def noun_phrase(rng: random.Random) -> str:
    det = rng.choice(("the", "a", "this", "my", "our", "every", "one"))
    adj = rng.choice(ADJECTIVES) + " " if rng.random() < 0.5 else ""
    noun = rng.choice(NOUNS) if rng.random() < 0.97 else pseudo_word(rng)
    plural = "s" if rng.random() < 0.2 else ""
    return f"{det} {adj}{noun}{plural}"


def english_sentence(rng: random.Random) -> str:
    subject = rng.choice(NAMES) if rng.random() < 0.3 else noun_phrase(rng)
    verb = rng.choice(VERBS)
    tense = rng.choice(("s", "ed", "", "ing"))
    if tense == "ing":
        verb = "is " + verb + "ing"
    elif tense:
        verb = verb + tense
    tail = " " + rng.choice(ADVERBS) if rng.random() < 0.3 else ""
    link = (
        f" {rng.choice(('of', 'in', 'to', 'for', 'with', 'on', 'from'))} {noun_phrase(rng)}"
        if rng.random() < 0.5
        else ""
    )
    clause = f"{subject} {verb} {noun_phrase(rng)}{link}{tail}"
    if rng.random() < 0.3:
        clause += f" {rng.choice(('because', 'when', 'while', 'so'))} {noun_phrase(rng)} {rng.choice(VERBS)}s"
    end = rng.choice((".", ".", ".", "!", "?"))
    return clause[0].upper() + clause[1:] + end


def english_question(rng: random.Random) -> str:
    topic = noun_phrase(rng)
    forms = (
        f"What is {topic}?",
        f"How do I {rng.choice(VERBS)} {topic}?",
        f"Can you explain why {topic} {rng.choice(VERBS)}s {noun_phrase(rng)}?",
        f"Write a short story about {topic}.",
        f"Give me {rng.randint(2, 9)} ideas for {topic}.",
        f"Summarize the following text: {english_sentence(rng)}",
        f"Translate to French: {english_sentence(rng)}",
        f"Is it true that {topic} is {rng.choice(ADJECTIVES)}?",
    )
    return rng.choice(forms)


def paragraph(rng: random.Random) -> str:
    return " ".join(english_sentence(rng) for _ in range(rng.randint(2, 6)))


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op = rng.choice(OPS)
    result = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 3)}[op]
    return f"What is {a} {op} {b}? We compute {a} {op} {b} = {result}."


def algebra(rng: random.Random) -> str:
    x, a, b = rng.randint(-20, 20), rng.randint(2, 12), rng.randint(-50, 50)
    c = a * x + b
    var = rng.choice("xyzn")
    return (
        f"Solve {a}{var} + {b} = {c}. Subtract {b} from both sides: {a}{var} = {c - b}. "
        f"Divide by {a}: {var} = {x}. Check: {a} * {x} + {b} = {c}."
    )


def latex_math(rng: random.Random) -> str:
    n, k = rng.randint(2, 12), rng.randint(1, 5)
    forms = (
        f"$\\frac{{{k}}}{{{n}}} + \\frac{{1}}{{{n}}} = \\frac{{{k + 1}}}{{{n}}}$",
        f"$x^{k} \\cdot x^{n} = x^{{{k + n}}}$",
        f"\\[ \\sum_{{i=1}}^{{{n}}} i = {n * (n + 1) // 2} \\]",
        f"The area is $\\pi r^2$ with $r = {n}$, so about {round(3.14159 * n * n, 2)}.",
        f"$\\sqrt{{{n * n}}} = {n}$ and ${n}^2 = {n * n}$.",
        f"**Answer:** $\\boxed{{{n * k}}}$",
    )
    return rng.choice(forms)


def identifier(rng: random.Random) -> str:
    parts = [rng.choice(VERBS), rng.choice(NOUNS)]
    if rng.random() < 0.3:
        parts.append(rng.choice(ADJECTIVES))
    return "_".join(parts) if rng.random() < 0.7 else parts[0] + "".join(p.title() for p in parts[1:])


def python_snippet(rng: random.Random) -> str:
    fn, arg, acc = identifier(rng), rng.choice(NOUNS) + "s", rng.choice(("total", "result", "count", "out"))
    body = rng.choice(
        (
            f"    {acc} = 0\n    for item in {arg}:\n        {acc} += item\n    return {acc}\n",
            f"    return [x * {rng.randint(2, 9)} for x in {arg} if x % 2 == 0]\n",
            f'    if not {arg}:\n        raise ValueError("empty {arg}")\n    return sorted({arg})[0]\n',
            f'    with open({arg}, "r", encoding="utf-8") as f:\n        return f.read().splitlines()\n',
            f"    {acc} = {{}}\n    for key, value in {arg}.items():\n        {acc}[key] = value\n    return {acc}\n",
        )
    )
    doc = f'    """{english_sentence(rng)}"""\n' if rng.random() < 0.4 else ""
    call = f"\n\nprint({fn}([{rng.randint(0, 9)}, {rng.randint(0, 9)}, {rng.randint(0, 9)}]))\n"
    return f"```python\ndef {fn}({arg}):\n{doc}{body}{call if rng.random() < 0.5 else ''}```"


def other_code(rng: random.Random) -> str:
    name, key = identifier(rng), rng.choice(NOUNS)
    forms = (
        (
            f'```javascript\nconst {key} = {{ id: {rng.randint(1, 99)}, name: "{rng.choice(NAMES)}" }};\n'
            f"console.log({key}.name);\n```"
        ),
        f'{{"{key}": {rng.randint(0, 500)}, "{rng.choice(NOUNS)}": "{rng.choice(ADJECTIVES)}", "ok": true}}',
        f"```bash\nmkdir -p {key}/{name}\ncd {key} && ls -la | grep {rng.choice(NOUNS)}\n```",
        f"```sql\nSELECT {key}, COUNT(*) FROM {name} WHERE {key} > {rng.randint(0, 100)} GROUP BY {key};\n```",
        f"```rust\nfn {name}(x: i32) -> i32 {{\n    x * {rng.randint(2, 9)} + 1\n}}\n```",
        f"```c\nint {name}(int n) {{\n    return n <= 1 ? n : {name}(n - 1) + {name}(n - 2);\n}}\n```",
    )
    return rng.choice(forms)


def chat_reply(rng: random.Random) -> str:
    items = "\n".join(f"{i}. {english_sentence(rng)}" for i in range(1, rng.randint(2, 5)))
    bullets = "\n".join(f"- **{rng.choice(NOUNS).title()}**: {english_sentence(rng)}" for _ in range(rng.randint(1, 3)))
    body = rng.choice((items, bullets, paragraph(rng), f"### Step {rng.randint(1, 5)}\n{paragraph(rng)}"))
    return f"{rng.choice(CHAT_OPENERS)} {english_sentence(rng)}\n\n{body}"


def reasoning(rng: random.Random) -> str:
    steps = [rng.choice(THOUGHTS)]
    steps.extend(thought_step(rng) for _ in range(rng.randint(2, 5)))
    return " ".join(steps)


def thought_step(rng: random.Random) -> str:
    maker = rng.choice((english_sentence, arithmetic, algebra, latex_math))
    prefix = rng.choice(THOUGHTS) + " " if rng.random() < 0.4 else ""
    return prefix + maker(rng)


GENERATORS: tuple[Callable[[random.Random], str], ...] = (
    paragraph,
    paragraph,
    word_stream,
    word_stream,
    english_question,
    english_question,
    arithmetic,
    algebra,
    latex_math,
    python_snippet,
    other_code,
    chat_reply,
    chat_reply,
    reasoning,
)


def iter_documents(seed: int = 0, count: int = 20000) -> Iterator[str]:
    """Yield ``count`` documents; the same arguments always give the same text."""
    rng = random.Random(seed)
    for _ in range(count):
        yield rng.choice(GENERATORS)(rng)
