#!/usr/bin/env python3
"""The reference renderings of chat templates: Python's jinja2 with Hugging Face's settings
(transformers' apply_chat_template: an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks,
loop controls and its {% generation %} tag; tojson = json.dumps(ensure_ascii=False, ...);
raise_exception; strftime_now).

usage: render_templates.py NOW CONTEXTS.json TEMPLATE.jinja...
Prints one JSON object per line for each template and context, in order:
  {"template": NAME, "case": INDEX, "ok": true, "output": TEXT}
  {"template": NAME, "case": INDEX, "ok": false, "raised": true|false, "error": MESSAGE}
("raised": the template's own raise_exception). strftime_now formats NOW (seconds, UTC).
"""
import datetime
import json
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Raised(jinja2.exceptions.TemplateError):
    pass


class AssistantTracker(Extension):  # renders {% generation %}...{% endgeneration %} as its body
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def main():
    now = datetime.datetime.fromtimestamp(int(sys.argv[1]), tz=datetime.timezone.utc)
    contexts = json.load(open(sys.argv[2], encoding="utf-8"))

    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    for path in sys.argv[3:]:
        name = path.rsplit("/", 1)[-1]
        source = open(path, encoding="utf-8").read()
        try:
            template = env.from_string(source)
        except Exception as e:  # noqa: BLE001 - every failure is a result
            for i in range(len(contexts)):
                print(json.dumps({"template": name, "case": i, "ok": False, "raised": False,
                                  "error": f"{type(e).__name__}: {e}"}, ensure_ascii=False))
            continue
        for i, context in enumerate(contexts):
            try:
                out = template.render(**context)
                print(json.dumps({"template": name, "case": i, "ok": True, "output": out}, ensure_ascii=False))
            except Raised as e:
                print(json.dumps({"template": name, "case": i, "ok": False, "raised": True, "error": str(e)},
                                 ensure_ascii=False))
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"template": name, "case": i, "ok": False, "raised": False,
                                  "error": f"{type(e).__name__}: {e}"}, ensure_ascii=False))


if __name__ == "__main__":
    main()
