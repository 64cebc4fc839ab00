// Engine: sessions over one shared page pool, a scheduler thread that owns the backend and runs
// continuous batching, and the session operations (generate, rollback, reset, fork, close).
// The gRPC service only adapts this API.
//
// Thread-safety: every public method is thread-safe. One scheduler thread runs all forwards,
// outside the engine's lock, so API calls do not wait for a step (info() on a generating session
// reports its cache as of the last step). Event sinks are called from the scheduler thread, outside
// the lock, in order per request; they must not block for long (a sink may call the engine). With a
// journal (EngineOptions::journal) a request's finished event comes last as ever, but from the
// journal's thread, once the request's tokens are durable.
//
// Semantics:
// - A session's token history is the source of truth; its KV pages are a cache of it. Under memory
//   pressure the scheduler drops the pages of idle sessions, least recently used first, and a
//   session rebuilds them by prefill on its next generate (transparently; usage reports it).
// - Host tier (EngineOptions::host_kv_memory_bytes): the pages an idle session gives up (and a
//   preempted request's) move to host memory instead of being dropped, and come back by copy on
//   its next use — where copying costs less than computing them again, which the engine measures
//   at start. Host copies are dropped last, least recently stored first, when the host tier is
//   full; a session whose copy went rebuilds by prefill as before. The copied K/V are bitwise what
//   was computed, so tokens are as if the pages had never left.
// - A session runs one operation at a time: generate, rollback, reset and fork on a session that is
//   generating fail with FAILED_PRECONDITION. close() cancels a running generate first.
// - Cancellation stops a generate at the next step; the tokens generated so far stay in the
//   session's history (and cache). The request finishes with reason "cancelled". A request that
//   fails (kError) is undone: the session's history is as before it.
// - Prefix cache (EngineOptions::prefix_cache): every full page of a session's history stays
//   addressed by its content (kv/prefix_cache.h) after the session moves on, rolls back, resets,
//   closes or is evicted, until the pool needs the memory (least recently released first; cached
//   pages never make a request wait or fail). A session whose history (a new one's prompt, one
//   after a rollback, an evicted one's) begins with cached pages of its namespace maps them, shared
//   as a fork's pages are, instead of prefilling them; the tokens are bitwise those of a prefill
//   (the runner is batch-invariant and its attention does not depend on how a sequence was split).
// - When pages run out and nothing idle can be dropped: requests that do not fit wait for running
//   ones to finish (EngineOptions::when_full = kWait) or fail with RESOURCE_EXHAUSTED (kFail); a
//   request that could not fit even in an empty pool fails with RESOURCE_EXHAUSTED either way. When
//   only waiting requests hold the pool (none can run), the most recent one that holds pages is
//   preempted: its pages go (to the host tier where there is one) and it waits, then resumes by
//   copying or rebuilding them, its tokens unchanged; so with kWait a request that fits the pool
//   alone never fails for lack of pages — unless it waits longer than
//   EngineOptions::queue_timeout (RESOURCE_EXHAUSTED, the request undone).
// - Sliding windows: on a model whose every layer is windowed, a session holds only the pages its
//   window (and a rollback margin) still reads (EngineOptions::release_behind_window).
// - Prompts are prefilled in chunks whose boundaries are multiples of prefill_chunk positions,
//   whatever else is in the step, and the runner is batch-invariant: a session's tokens do not
//   depend on the other sessions sharing its steps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "combs/base/status.h"
#include "combs/engine/journal.h"
#include "combs/engine/speculation.h"
#include "combs/model/model.h"
#include "combs/model/runner.h"
#include "combs/model/sampler.h"

namespace combs {

// 32 lowercase hex digits. The first 16 name the session's family: random for a new session,
// inherited by its forks, so a session-affine proxy that hashes them sends a family to the replica
// that holds it; the last 16 are random for every session.
using SessionId = std::string;

struct EngineOptions {
  int64_t kv_memory_bytes = int64_t{1} << 30;  // the page pool's budget (each GPU's, under tensor parallelism)
  // When > 0 and the runner's device reports its free memory (a GPU): the budget is this
  // fraction of the memory free once the weights are loaded, instead of kv_memory_bytes.
  double kv_memory_fraction = 0.0;
  DType kv_dtype = DType::kF16;                // K/V storage
  int page_size = 16;
  int threads = 0;                             // CPU threads; 0: all
  int max_sessions = 1024;
  int64_t max_context = 0;                     // per session; 0: the model's context length
  int max_tokens_per_request = 4096;
  int64_t step_token_budget = 512;             // tokens per forward (decodes + prefill chunks)
  int64_t prefill_chunk = 128;                 // prefill chunk boundaries: multiples of this
  std::chrono::milliseconds session_ttl{std::chrono::minutes(30)};  // idle sessions expire
  enum class WhenFull : uint8_t { kWait, kFail } when_full = WhenFull::kWait;
  // A request that makes no progress for this long (waiting for pages or a place in a step) ends
  // with RESOURCE_EXHAUSTED, undone; 0: it waits as long as it takes.
  std::chrono::milliseconds queue_timeout{0};
  // The host tier: bytes of host memory (pinned on a GPU) for K/V pages moved off the device pool
  // under pressure (see Semantics); 0: none, pages that must go are dropped.
  int64_t host_kv_memory_bytes = 0;
  // kAuto: at start, time a prefill on this model and device against copying the same positions'
  // pages to the host and back, and keep the tier only where copying is cheaper (EngineStats says
  // which and the figures). kCopy: always use it.
  enum class HostRestore : uint8_t { kAuto, kCopy } host_kv_restore = HostRestore::kAuto;
  // Makes the runner (and so picks the device: the KV pages live on its backend). Empty: the CPU
  // runner on `threads` threads. combs_cuda's make_cuda_runner() gives the GPU one.
  std::function<StatusOr<std::unique_ptr<ModelRunner>>(const Model&)> make_runner;
  // The chat template (Jinja source) for chat(); empty: the model file's tokenizer.chat_template.
  // A model with neither refuses chat turns (FAILED_PRECONDITION): a guessed default would give it
  // prompts in a format it was not trained on.
  std::string chat_template;
  // The prefix cache (see Semantics above); off: pages go back to the pool when no session holds
  // them, as they did before it.
  bool prefix_cache = true;
  // Where every change to a session is recorded (engine/journal.h; not owned, outlives the
  // engine); null: none. With one, a request's finished event is delivered by the journal once its
  // tokens are durable (from the journal's thread).
  SessionJournal* journal = nullptr;
  // Sessions to start with (a journal's, at a restart): their histories, no pages (the first use
  // prefills them, or maps them from the prefix cache). A record that does not fit this model or
  // these limits makes create() fail naming it.
  std::vector<SessionRecord> restore;
  // Where SpeculationParams::Method::kNgram requests' drafts come from; null: the n-gram prompt
  // lookup (NgramProposer). Benchmarks and tests give drafts of a known quality here.
  std::shared_ptr<Proposer> proposer;
  // Speculation for sessions that set none (SessionOptions::speculation): off by default.
  SpeculationParams speculation;
  // SpeculationParams::Method::kDraft's drafts: a smaller model of the same vocabulary (refused at
  // create otherwise), run by make_runner's kind of runner with its own KV pages (DraftModel).
  std::shared_ptr<const Model> draft_model;
  int64_t draft_kv_memory_bytes = int64_t{256} << 20;
  // A model whose every layer attends through a sliding window (ModelConfig::layer_windowed all
  // set) reads no key behind it again: after each step a session's full pages behind its window
  // go back to the pool, less window_rollback positions kept for a rollback (a client's, a chat
  // edit's, a rejected draft's). A rollback further back rebuilds the session's cache from its
  // history, as after an eviction (EngineStats::window_rebuilds). Off: pages stay until the
  // session drops them.
  bool release_behind_window = true;
  int64_t window_rollback = 128;
};

struct SessionOptions {
  SamplingParams sampling;  // defaults of its generates
  int64_t max_context = 0;  // 0: the engine's
  // Sessions share cached prefix pages only within one namespace (a server gives each tenant its
  // own, so one tenant's prompts never serve, or time-signal, another's). Forks inherit it.
  std::string cache_namespace;
  std::string owner;  // opaque to the engine (the server's API key); kept, journaled, inherited by forks
  // The default of its generates; unset: EngineOptions::speculation (not journaled: a restored
  // session takes the engine's).
  std::optional<SpeculationParams> speculation;
};

struct GenerateRequest {
  std::vector<int32_t> input;                      // appended to the history first
  int max_tokens = 0;                              // 0: only extend the session
  std::optional<SamplingParams> sampling;          // else the session's defaults
  std::vector<std::vector<int32_t>> stop_sequences;
  // Stop strings: the request ends (kStop) with the token whose text completes one (the model
  // needs a tokenizer; INVALID_ARGUMENT otherwise or for an empty string).
  std::vector<std::string> stop_strings;
  bool ignore_eos = false;
  std::optional<SpeculationParams> speculation;  // else the session's default
};

// A chat turn: the session's conversation with new messages, rendered with the model's chat
// template (tokenizer.chat_template, or EngineOptions::chat_template), tokenized and compared with
// the session's history. Only what differs is computed: the history is rolled back to the longest
// prefix the new rendering shares with it (nothing before is recomputed) and the rest appended;
// then the reply is generated until an end of generation and joins the conversation.
struct ChatRequest {
  // Messages, each {"role": "...", "content": "..."} (text content), appended to the session's
  // conversation; with `replace`, the whole conversation instead: editing or dropping an earlier
  // message rolls the session back to where the rendering changes.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  bool replace = false;
  // More template variables (a JSON object: tools, enable_thinking, ...). bos_token and eos_token
  // default to the vocabulary's; add_generation_prompt is true.
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  int max_tokens = 0;  // of the reply
  std::optional<SamplingParams> sampling;
  std::vector<std::string> stop_strings;
  bool ignore_eos = false;
};

struct Usage {
  int64_t input_tokens = 0;      // appended by the request
  int64_t output_tokens = 0;     // generated
  int64_t prefilled_tokens = 0;  // positions computed by prefill (input + rebuilt history)
  int64_t cached_tokens = 0;     // history positions whose pages were reused (the session's own, the prefix cache's or the host tier's)
  int64_t drafted_tokens = 0;    // speculation: tokens drafted and verified
  int64_t accepted_tokens = 0;   // of which the model agreed with (each saved a forward)
};

enum class FinishKind : uint8_t { kLength, kEos, kStop, kCancelled, kError };
std::string_view finish_kind_name(FinishKind k);

struct GenerateEvent {
  enum class Type : uint8_t { kToken, kFinished } type = Type::kToken;
  int32_t token = -1;   // kToken
  std::string text;     // kToken: the text this token completes (may be empty); kFinished:
                        // bytes held back until the end (an unfinished UTF-8 character)
  FinishKind finish = FinishKind::kLength;  // kFinished
  Status status;                            // kFinished: the error for kError
  Usage usage;                              // kFinished
  int64_t session_length = 0;               // kFinished: tokens in the session afterwards
};
using EventSink = std::function<void(const GenerateEvent&)>;

// Returned by generate(): cancel() stops it at the next step (safe from any thread, any time).
class GenerateHandle {
 public:
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
};

struct SessionInfo {
  SessionId id;
  int64_t length = 0;         // tokens in the history
  int64_t cached = 0;         // of which have K/V in pages
  int64_t pages_held = 0;
  int64_t pages_shared = 0;   // held pages another session holds too
  bool generating = false;
  SamplingParams sampling;    // the session's defaults
  std::string owner;          // SessionOptions::owner
  SessionId parent;           // the session it was forked from, if any
  int64_t drafted_tokens = 0, accepted_tokens = 0;  // speculation over its requests
};

struct EngineStats {
  int64_t sessions = 0, pages_total = 0, pages_used = 0, pages_free = 0, evictions = 0, steps = 0;
  int64_t generating = 0;       // requests in progress
  int64_t waiting = 0;          // of which had no place in the last step (the queue depth)
  int64_t batch_sequences = 0;  // sequences in the last step's forward
  int64_t batch_tokens = 0;     // tokens in the last step's forward
  int64_t forward_tokens = 0;   // tokens through the model since the start
  // The prefix cache: requests that looked a prefix up, those that found at least one page, the
  // positions they mapped; pages it names (of which only it holds), pages taken back for reuse.
  int64_t prefix_lookups = 0, prefix_hits = 0, prefix_hit_tokens = 0;
  int64_t pages_cached = 0, pages_reclaimable = 0, cached_pages_reclaimed = 0;
  int64_t preemptions = 0;  // waiting requests whose pages were taken so that others could run
  // Sliding windows (EngineOptions::release_behind_window): pages given back from behind the
  // sessions' windows, and caches rebuilt for a rollback into released positions.
  int64_t window_pages_released = 0, window_rebuilds = 0;
  int64_t queue_timeouts = 0;  // requests ended for waiting past EngineOptions::queue_timeout
  int64_t drafted_tokens = 0, accepted_tokens = 0;  // speculation
  // The draft model (all 0 without one): its forwards, the sessions it keeps a draft cache of, and
  // its caches dropped for room in its pool (rebuilt from the history when next needed).
  int64_t draft_forwards = 0, draft_sessions = 0, draft_cache_evictions = 0;
  // The host tier: its pages (0 without one) and those holding session copies; sessions whose
  // pages moved there, those whose pages came back (and the positions that did), copies dropped
  // for room. The start-up measurement, microseconds per token: prefill, and the copy to the host
  // and back (0 when not measured); host_tier_active: whether the tier is in use.
  int64_t host_pages_total = 0, host_pages_used = 0;
  int64_t host_offloads = 0, host_restores = 0, host_restored_tokens = 0, host_copies_dropped = 0;
  double host_prefill_us_per_token = 0.0, host_copy_us_per_token = 0.0;
  bool host_tier_active = false;
};

class Engine {
 public:
  // Takes the model; starts the scheduler thread.
  static StatusOr<std::unique_ptr<Engine>> create(std::unique_ptr<Model> model, EngineOptions options);
  ~Engine();  // running generates finish with kError (UNAVAILABLE)

  StatusOr<SessionId> create_session(const SessionOptions& options = {});
  // INVALID_ARGUMENT (bad token or sampling value), NOT_FOUND, FAILED_PRECONDITION (busy),
  // RESOURCE_EXHAUSTED (context or request limits).
  StatusOr<std::shared_ptr<GenerateHandle>> generate(const SessionId& id, GenerateRequest request,
                                                     EventSink sink);
  // A chat turn (ChatRequest). INVALID_ARGUMENT for bad messages or where the template fails on
  // them (its message: an unknown role, a missing content); FAILED_PRECONDITION without a chat
  // template; otherwise as generate(). On finishing (not on an error) the reply (the generated
  // text without the end-of-generation token) joins the conversation as the assistant's message.
  StatusOr<std::shared_ptr<GenerateHandle>> chat(const SessionId& id, ChatRequest request, EventSink sink);
  bool has_chat_template() const;  // chat() can run
  // The prompt chat() would give a new session: `messages` rendered with the chat template and
  // tokenized (for a stateless API whose requests carry the whole conversation). Errors as chat().
  StatusOr<std::vector<int32_t>> render_chat(const nlohmann::ordered_json& messages,
                                             const nlohmann::ordered_json& variables = nlohmann::ordered_json::object()) const;
  // The session's conversation (chat turns' messages and replies; reset empties it).
  StatusOr<nlohmann::ordered_json> conversation(const SessionId& id);
  // Drops the last n tokens; returns the new length. n > length is OUT_OF_RANGE.
  StatusOr<int64_t> rollback(const SessionId& id, int64_t n);
  Status reset(const SessionId& id);
  StatusOr<SessionId> fork(const SessionId& id);
  Status close(const SessionId& id);
  // A session as bytes (encode_session: history, defaults, lineage, the model's fingerprint, a
  // checksum), to move it to another replica. FAILED_PRECONDITION while it generates.
  StatusOr<std::string> export_session(const SessionId& id);
  // Adds an exported session under its own id (its family keeps its routing), owned by `owner` and
  // in `cache_namespace` (the importer's, not the blob's). INVALID_ARGUMENT / FAILED_PRECONDITION
  // for a bad or foreign blob or one that does not fit this engine, ALREADY_EXISTS when the id is
  // taken; nothing is imported then.
  StatusOr<SessionId> import_session(std::string_view blob, const std::string& owner, const std::string& cache_namespace);
  StatusOr<SessionInfo> info(const SessionId& id);
  std::vector<SessionInfo> list();
  EngineStats stats();
  // Ends every running generate with kError(why) at the scheduler's next step (after the forward
  // in progress; returns at once); for a server whose shutdown grace period ran out.
  void abort_generating(const Status& why);
  const Model& model() const;
  // The limits requests meet: positions per session (EngineOptions::max_context, or the model's
  // context length) and max_tokens per request.
  int64_t max_context() const;
  int max_tokens_per_request() const;
  int64_t kv_capacity_tokens() const;  // positions the page pool holds in all
  // Whether sessions give back the pages behind their sliding window (EngineOptions::
  // release_behind_window on an all-windowed model): a session's history may then outgrow the pool.
  bool releases_behind_window() const;
  // OK while the model runner can serve; UNAVAILABLE once it cannot (ModelRunner::health: a
  // tensor-parallel group that lost a rank). Safe from any thread.
  Status runner_health() const;

  // Test hook: pages in use equal the distinct pages the sessions hold or the prefix cache names;
  // every page's reference count is its holders (+1 when cached); cached pages that sessions hold
  // at full positions are named by those positions' keys; host pages likewise, and a session's
  // host copy covers no more than its history.
  Status check_invariants();

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace combs
