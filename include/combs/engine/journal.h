// The session journal: where the engine records every change to its sessions, so that they
// survive a restart or a crash (EngineOptions::journal), and what it loads them from.
//
// The engine calls a journal under its own lock, in the order the changes happen; an
// implementation only queues them (a step never waits for the disk) and makes them durable on its
// own thread. barrier() is how a finished request waits for its tokens: the engine hands it the
// request's last event, and the journal delivers it once everything recorded before is durable.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "combs/model/sampler.h"

namespace combs {

using SessionId = std::string;

// A session as the journal holds it: enough to rebuild it (its pages are rebuilt by prefill, or
// from the prefix cache, on first use).
struct SessionRecord {
  SessionId id;
  SessionId parent;                // the session it was forked from; empty for a new one
  std::string owner;               // opaque to the engine (the server's API key)
  std::string cache_namespace;     // the prefix cache's
  SamplingParams sampling;         // the session's defaults
  int64_t max_context = 0;
  std::vector<int32_t> history;
  nlohmann::ordered_json conversation = nlohmann::ordered_json::array();
  // When its last change was recorded (Unix milliseconds; 0: unknown, as now): a restored session
  // keeps the time to live it had left.
  int64_t last_used_unix_ms = 0;
};

// SamplingParams as JSON and back (INVALID_ARGUMENT naming a bad field).
nlohmann::ordered_json sampling_to_json(const SamplingParams& p);
StatusOr<SamplingParams> sampling_from_json(const nlohmann::ordered_json& j);

// A session as bytes, for moving it between replicas of one model: "COMBSSES", a format version,
// a JSON header (the model's fingerprint, the record's fields but the history), the history as
// little-endian int32, and a SHA-256 of everything before it.
std::string encode_session(const SessionRecord& record, std::string_view model_fingerprint);
// INVALID_ARGUMENT for bytes that are not such a blob (or fail the checksum); FAILED_PRECONDITION
// for one of another model.
StatusOr<SessionRecord> decode_session(std::string_view blob, std::string_view model_fingerprint);

class SessionJournal {
 public:
  virtual ~SessionJournal() = default;
  // A session made, forked or restored: the whole record (history included).
  virtual void put(const SessionRecord& record) = 0;
  // tokens appended at position `at` (== the history's length before).
  virtual void append(const SessionId& id, int64_t at, std::span<const int32_t> tokens) = 0;
  // The history cut to `length` tokens (a rollback, a reset, a failed request undone).
  virtual void truncate(const SessionId& id, int64_t length) = 0;
  virtual void set_conversation(const SessionId& id, const nlohmann::ordered_json& conversation) = 0;
  virtual void erase(const SessionId& id) = 0;  // closed or expired
  // Runs `done` (on the journal's thread) once everything recorded before it is durable.
  virtual void barrier(std::function<void()> done) = 0;
};

}  // namespace combs
