#!/usr/bin/python3
"""A combs client in Python (Debian's python3-grpcio), with stubs generated from proto/ at test
time: runs a session through create / generate / rollback / reset / close, then a chat, against a combs-server
subprocess, so the wire contract is checked from outside C++.

usage: python_client_test.py COMBS_SERVER_BIN PROTO_DIR VOCAB_GGUF
"""
import os
import subprocess
import sys
import tempfile

server_bin, proto_dir, vocab = sys.argv[1:4]
work = tempfile.mkdtemp(prefix="combs-pytest-")
subprocess.run(["protoc", f"--proto_path={proto_dir}", f"--python_out={work}", f"--grpc_out={work}",
                "--plugin=protoc-gen-grpc=" + (subprocess.run(["sh", "-c", "command -v grpc_python_plugin"],
                                                              capture_output=True, text=True).stdout.strip()),
                "combs/v1/combs.proto"], check=True)
sys.path.insert(0, work)

import grpc  # noqa: E402
from combs.v1 import combs_pb2 as pb  # noqa: E402
from combs.v1 import combs_pb2_grpc as rpc  # noqa: E402

server = subprocess.Popen([server_bin, "--listen", "127.0.0.1:0", "--cache-dir", os.path.join(work, "cache"),
                           "--threads", "2", "--kv-memory-mib", "64", "--vocab", vocab],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


try:
    address = None
    for line in server.stdout:
        if " serving " in line:
            address = line.strip().rsplit(" on ", 1)[1]
            break
    assert address, "combs-server did not start"
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=10)
    stub = rpc.CombsStub(channel)

    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
    check(len(sid) == 32, "CreateSession returns a 128-bit hex id")

    def generate(**kw):
        tokens, last = [], None
        for r in stub.Generate(pb.GenerateRequest(session_id=sid, **kw)):
            if r.finished:
                last = r
            else:
                tokens.append(r.token_id)
        return tokens, last

    greedy = pb.SamplingParams(temperature=0.0)
    first, last = generate(tokens=pb.TokenIds(ids=[128000, 9906, 1917]), max_tokens=6, sampling=greedy,
                           ignore_eos=True)
    check(len(first) == 6 and last.finish_reason == pb.FINISH_REASON_LENGTH, "Generate streams 6 tokens")
    check(last.usage.input_tokens == 3 and last.usage.output_tokens == 6, "usage counts input and output")
    check(stub.GetSession(pb.GetSessionRequest(session_id=sid)).length == 9, "the session holds 9 tokens")
    check(stub.Rollback(pb.RollbackRequest(session_id=sid, n=6)).length == 3, "Rollback returns the new length")
    again, _ = generate(max_tokens=6, sampling=greedy, ignore_eos=True)
    check(again == first, "greedy after rollback repeats the tokens")
    text, last = generate(text=" and", max_tokens=3, sampling=greedy, ignore_eos=True)
    check(len(text) == 3 and last.usage.input_tokens == 1, "text input goes through the server's tokenizer")
    try:
        stub.Rollback(pb.RollbackRequest(session_id=sid, n=1000))
        check(False, "over-long rollback fails")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.OUT_OF_RANGE, "over-long rollback is OUT_OF_RANGE")
    stub.Reset(pb.ResetRequest(session_id=sid))
    check(stub.GetSession(pb.GetSessionRequest(session_id=sid)).length == 0, "Reset empties the session")
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    try:
        stub.GetSession(pb.GetSessionRequest(session_id=sid))
        check(False, "a closed session is gone")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.NOT_FOUND, "a closed session is NOT_FOUND")

    # A chat: the default model carries Llama 3's chat template.
    check(stub.GetModelInfo(pb.GetModelInfoRequest()).has_chat_template, "the default model has a chat template")
    chat = stub.CreateSession(pb.CreateSessionRequest()).session_id

    def turn(messages, **kw):
        req = pb.ChatRequest(session_id=chat, messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                             max_tokens=5, sampling=greedy, **kw)
        last, text = None, ""
        for r in stub.Chat(req):
            text += r.text
            if r.finished:
                last = r
        return text, last

    reply, last = turn([("system", "Be brief."), ("user", "Hello!")], variables_json='{"date_string": "2 Dec 2026"}')
    check(last is not None and last.usage.output_tokens >= 1, "Chat streams a reply")
    conv = stub.GetConversation(pb.GetConversationRequest(session_id=chat)).messages
    check([m.role for m in conv] == ["system", "user", "assistant"], "the reply joins the conversation")
    length = stub.GetSession(pb.GetSessionRequest(session_id=chat)).length
    _, last = turn([("user", "And then?")], variables_json='{"date_string": "2 Dec 2026"}')
    check(last.usage.cached_tokens == length - 1, "the second turn reuses the whole first one")
    check(last.usage.prefilled_tokens < 20, "the second turn computes only its new tokens")
    try:
        turn([("user", "x")], variables_json="[1, 2]")
        check(False, "variables that are not an object fail")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, "variables that are not an object are INVALID_ARGUMENT")
    try:
        turn([("", "no role")])
        check(False, "a message without a role fails")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, "a message without a role is INVALID_ARGUMENT")
finally:
    server.terminate()
    check(server.wait(timeout=30) == 0, "combs-server exits 0 on SIGTERM")
sys.exit(1 if failures else 0)
