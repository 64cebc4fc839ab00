#!/usr/bin/python3
"""The gpt-4o / o200k pre-tokenizer's words (gpt-oss's tokenizer), from its published expression.

The reference for combs' "gpt-4o" pre-tokenizer: the expression of o200k's tokenizer.json (as
llama.cpp quotes it beside its own rewrite), run by Python's `regex` module (Debian's
python3-regex), which has the Unicode properties and scoped flags it uses. Inputs: every case of
llama.cpp's tokenizer test texts in tests/data/vocab/*.inp and a few of gpt-oss's own (Harmony
markup, cased words, contractions, long numbers, CRLF).

Writes tests/data/vocab/gpt-4o.words.jsonl: one JSON object per line, {"text": ..., "words": [...]}.
  /usr/bin/python3 tests/reference/pretokenize_gpt4o.py
"""
import glob
import json
import os

import regex

O200K = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

EXTRA = [
    "<|start|>assistant<|channel|>analysis<|message|>We need to answer.<|end|>",
    "<|start|>user<|message|>What's 2+2? I'M SURE it's 4.<|end|><|start|>assistant",
    "HTTPServer parsesJSON quickly; camelCaseWords and ALLCAPS'LL stay",
    "1234567890 3.14159 1,000,000 and 42nd",
    "line one\r\nline two\r\n\r\n  indented\ttab\n",
    "path/to/file.txt //comment\n/* block */",
    "naïve café résumé — «quotes» “curly” ‘single’",
    "Ünïcödé COMBINING: e\u0301 a\u0308 n\u0303",
    "日本語のテキストと中文字符 한국어 텍스트",
    "emoji 🙂🚀 mixed👍🏽text",
    "   leading and trailing spaces   ",
    "a  b   c    d\n\n\ne",
    "don't won't shouldn't I've you'd they'll we're",
]


def cases(root):
    seen = []
    for path in sorted(glob.glob(os.path.join(root, "tests/data/vocab/*.inp"))):
        with open(path, encoding="utf-8") as f:
            for text in f.read().split("\n__ggml_vocab_test__\n"):
                if text not in seen:
                    seen.append(text)
    for text in EXTRA:
        if text not in seen:
            seen.append(text)
    return seen


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pattern = regex.compile(O200K)
    out = os.path.join(root, "tests/data/vocab/gpt-4o.words.jsonl")
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for text in cases(root):
            words = [m.group(0) for m in pattern.finditer(text)]
            assert "".join(words) == text, "the expression does not cover %r" % text
            f.write(json.dumps({"text": text, "words": words}, ensure_ascii=False) + "\n")
            n += 1
    print("wrote %s (%d cases)" % (out, n))


if __name__ == "__main__":
    main()
