#include "combs/engine/engine.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <random>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "combs/backend/cpu/cpu_backend.h"
#include "combs/chat/jinja.h"
#include "combs/engine/draft_model.h"
#include "combs/kv/host_page_pool.h"
#include "combs/kv/paged_kv_cache.h"
#include "combs/kv/prefix_cache.h"
#include "combs/model/runner.h"
#include "combs/model/tokenizer.h"

namespace combs {

std::string_view finish_kind_name(FinishKind k) {
  switch (k) {
    case FinishKind::kLength: return "length";
    case FinishKind::kEos: return "eos";
    case FinishKind::kStop: return "stop";
    case FinishKind::kCancelled: return "cancelled";
    case FinishKind::kError: return "error";
  }
  return "error";
}

namespace {
using Clock = std::chrono::steady_clock;

// The state of a running generate.
struct Active {
  GenerateRequest request;
  EventSink sink;
  std::shared_ptr<GenerateHandle> handle;
  std::unique_ptr<Sampler> sampler;
  StopCriteria stop;
  std::unique_ptr<StreamDecoder> text;
  std::string generated_text;  // for stop strings
  std::vector<int32_t> generated;
  Usage usage;
  bool counted_cache = false;  // usage.cached_tokens set and the prefix cache looked up
  std::optional<Clock::time_point> waiting_since;  // when it last made progress, while it waits
  // Speculation (request's, else the session's): how many tokens the next step drafts.
  SpeculationParams speculation;
  DraftLength* draft_length = nullptr;  // the session's, when speculation is on
  size_t history_before = 0;  // a request that fails leaves the session as it found it
  Clock::time_point arrival = Clock::now();  // when it was accepted: its claim on pages
  // A chat turn's: the conversation it rendered and the rendering (the reply joins them at the end).
  std::optional<nlohmann::ordered_json> chat_conversation;
  std::string chat_rendering;
};

// A session's copy of history[0, len) in the host tier: pages[i] holds positions
// [i * page_size, (i + 1) * page_size). Its references go with it.
class HostCopy {
 public:
  HostCopy() = default;
  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;
  ~HostCopy() { clear(); }

  bool empty() const { return len_ == 0; }
  int64_t len() const { return len_; }
  std::span<const int32_t> pages() const { return pages_; }
  Clock::time_point stored() const { return stored_; }
  // Takes over the references of `pages`, holding positions [0, len).
  void set(HostPagePool& pool, std::vector<int32_t> pages, int64_t len) {
    clear();
    pool_ = &pool;
    pages_ = std::move(pages);
    len_ = len;
    stored_ = Clock::now();
  }
  // Keeps positions [0, min(len, n)) (a history cut to n).
  void trim(int64_t n) {
    if (n >= len_) return;
    len_ = n;
    const auto keep = static_cast<size_t>(pages_for_tokens(n, pool_->device().page_size()));
    while (pages_.size() > keep) {
      pool_->release(pages_.back());
      pages_.pop_back();
    }
    if (len_ == 0) pool_ = nullptr;
  }
  void clear() { trim(0); }
  // Shares o's copy (a fork).
  void share(const HostCopy& o) {
    clear();
    if (o.empty()) return;
    for (int32_t p : o.pages_) o.pool_->retain(p);
    pool_ = o.pool_;
    pages_ = o.pages_;
    len_ = o.len_;
    stored_ = o.stored_;
  }

 private:
  HostPagePool* pool_ = nullptr;
  std::vector<int32_t> pages_;
  int64_t len_ = 0;
  Clock::time_point stored_;
};

struct Session {
  SessionId id;
  SessionId parent;  // forked from
  SessionOptions options;
  int64_t max_context = 0;
  std::vector<int32_t> history;  // the source of truth
  std::unique_ptr<PagedKVCache> cache;  // K/V of history[0, cache->seq_len())
  Clock::time_point last_used;
  std::unique_ptr<Active> active;
  bool closing = false;  // closed while generating: the scheduler ends the request, then erases it
  // What info() reports while the session is generating (its cache is then the scheduler's).
  int64_t snap_cached = 0, snap_pages = 0, snap_shared = 0;
  uint64_t edits = 0;  // history changes (a chat turn prepared outside the lock checks it)
  // Chat: the conversation, and the text the history is the tokens of when the last change was a
  // chat turn (chat_text_valid): a next rendering that extends it needs only its new part
  // tokenized; otherwise the turn compares tokens with the history.
  nlohmann::ordered_json conversation = nlohmann::ordered_json::array();
  std::string chat_text;
  bool chat_text_valid = false;
  // The prefix cache's keys of the history's full pages: chain[i] names pages 0..i (extended as
  // needed, cut where the history shrinks); chain_root is link 0 (the model and the namespace).
  Digest chain_root{};
  std::vector<Digest> chain;
  int64_t drafted = 0, accepted = 0;  // speculation's tokens over its requests
  std::optional<DraftLength> draft_length;  // of its requests that speculate as draft_for says
  SpeculationParams draft_for;
  // Positions whose K/V moved to the host tier: beyond the cache (which holds a prefix of them, or
  // none), copied back on the next use; trimmed with the history.
  HostCopy host;
};

SessionRecord record_of(const Session& s) {
  SessionRecord r;
  r.id = s.id;
  r.parent = s.parent;
  r.owner = s.options.owner;
  r.cache_namespace = s.options.cache_namespace;
  r.sampling = s.options.sampling;
  r.max_context = s.max_context;
  r.history = s.history;
  r.conversation = s.conversation;
  return r;
}

void snapshot(Session& s) {
  s.snap_cached = s.cache->seq_len();
  s.snap_pages = *s.cache->pages_used();
  s.snap_shared = s.cache->pages_shared();
}

// family: the first 16 hex digits of the new id (a fork's parent's); empty: random too.
SessionId random_id(std::string_view family = {}) {
  thread_local std::mt19937_64 gen{std::random_device{}() ^
                                   (uint64_t(std::hash<std::thread::id>{}(std::this_thread::get_id())) << 1)};
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen()));
  if (family.size() == 16) std::copy(family.begin(), family.end(), buf);
  return buf;
}

}  // namespace

struct Engine::Impl {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the model file has none
  std::optional<jinja::Template> chat_template;
  std::string no_chat_template;          // why chat() is refused when there is none
  EngineOptions options;
  CpuBackend backend;                    // the CPU runner's
  std::unique_ptr<ModelRunner> runner;   // its backend holds the pool's memory: declared first,
  std::unique_ptr<PagePool> pool;        // destroyed after the pool
  std::unique_ptr<HostPagePool> host;    // the host tier; null: none (or it does not pay)
  std::unique_ptr<PrefixCache> prefix;   // null when off; goes before the pool
  std::string model_fingerprint;
  // The window of a model whose every layer is windowed, when pages behind it are released
  // (EngineOptions::release_behind_window); 0: none are.
  int64_t release_window = 0;

  std::mutex mu;
  std::condition_variable wake;
  // Set while a forward runs outside the lock: the caches in the step belong to the scheduler.
  bool in_forward = false;
  std::condition_variable forward_done;
  std::unordered_map<SessionId, std::unique_ptr<Session>> sessions;
  bool stopping = false;
  // The scheduler's counters and the last step's figures; stats() adds the pool's and the
  // sessions' from the same lock.
  EngineStats counts;
  // The arrival of the earliest request that waited for pages while holding some (see step()).
  std::optional<Clock::time_point> page_priority;
  Status abort;  // set by abort_generating(); the scheduler ends the running requests with it
  std::thread scheduler;

  std::shared_ptr<Proposer> proposer;  // SpeculationParams::kNgram's drafts
  std::shared_ptr<DraftModel> draft;   // kDraft's (EngineOptions::draft_model); null without one
  // Scratch of the scheduler thread.
  std::vector<int32_t> spec_history;
  std::vector<float> logits;
  std::vector<int32_t> token_ids;
  std::vector<RowSampling> row_sampling;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> penalized;
  std::vector<uint64_t> generator_before;

  explicit Impl(EngineOptions o) : options(o), backend(CpuBackendOptions{o.threads}) {}

  Session* find(const SessionId& id) {
    auto it = sessions.find(id);
    return it == sessions.end() || it->second->closing ? nullptr : it->second.get();
  }
  StatusOr<Session*> idle(const SessionId& id) {
    Session* s = find(id);
    if (s == nullptr) return not_found_error("session " + id + " not found");
    if (s->active) return failed_precondition_error("session " + id + " is generating");
    return s;
  }

  // The checks of a generate or chat request that need no session.
  Status check_request(std::string_view who, int max_tokens, const std::vector<std::string>& stop_strings,
                       const EventSink& sink) const {
    const std::string w(who);
    if (max_tokens < 0) return invalid_argument_error(w + ": max_tokens must be >= 0");
    if (max_tokens > options.max_tokens_per_request) {
      return resource_exhausted_error(w + ": max_tokens " + std::to_string(max_tokens) + " exceeds the limit of " +
                                      std::to_string(options.max_tokens_per_request));
    }
    if (!sink) return invalid_argument_error(w + ": no event sink");
    for (const std::string& stop : stop_strings) {
      if (stop.empty()) return invalid_argument_error(w + ": empty stop string");
    }
    return ok_status();
  }
  // Starts a generate on the idle session s (the lock held): the checks that need the session,
  // then the request joins the scheduler's work.
  StatusOr<std::shared_ptr<GenerateHandle>> start(Session* s, GenerateRequest request, EventSink sink,
                                                  std::unique_ptr<Active> a);
  // The prefix cache's key of history page i of s (the chain extended as needed).
  const Digest& page_key(Session& s, int64_t i);
  // Drops s's cached positions from `keep` on; where the window of the next position would then
  // read released positions, the whole cache goes (it rebuilds from the history by prefill).
  void truncate_cache(Session& s, int64_t keep);
  // Gives back s's pages behind its window, less the rollback margin (see release_window).
  void release_behind_window(Session& s);
  // After s's history shrank: its chain keeps only the pages still whole.
  void trim_chain(Session& s) {
    s.chain.resize(std::min(s.chain.size(), s.history.size() / static_cast<size_t>(pool->page_size())));
  }
  // Maps the cached pages that continue s's cache (at a page boundary), leaving at least the
  // history's last position to compute; the positions mapped.
  // `spare`: reclaimable pages it may take (free and reclaimable pages beyond what the step has
  // reserved for the work chosen before).
  int64_t map_cached_prefix(Session& s, int64_t spare, bool* looked);
  // When s's cache ends mid-page and the page after that one is cached (and would be mapped): the
  // position where the current page ends; else 0.
  int64_t next_page_cached(Session& s);
  // Names s's pages that positions [from, to) completed in the prefix cache.
  void cache_filled_pages(Session& s, int64_t from, int64_t to);
  // A conversation rendered with the chat template (chat() and render_chat()).
  StatusOr<std::string> render(const nlohmann::ordered_json& conversation, const nlohmann::ordered_json& variables) const;
  // A session of a record (a journal's or an import's), checked against the model and the limits;
  // `what` begins its errors.
  StatusOr<std::unique_ptr<Session>> session_from(SessionRecord r, const std::string& what);
  void run();
  void step(std::unique_lock<std::mutex>& lock);
  void sweep_expired();
  bool evict_one_idle(const std::set<Session*>& keep);
  // The drafts of the step's decoding sessions that speculate, each proposer's in one call (a
  // draft model's as one batch per drafted position).
  struct StepDrafts {
    std::unordered_map<Session*, std::vector<int32_t>> tokens;  // each session's drafts
    std::set<Session*> asked;  // sessions that asked for drafts (some got none: a draft cache catching up)
    // Each speculating session's draft length before this step's next(): put back where the step
    // does not run as decided (not chosen, or no drafts), so that only steps that ran count.
    std::unordered_map<Session*, DraftLength> before;
  };
  void propose_drafts(const std::vector<Session*>& order, StepDrafts* drafts);
  // INVALID_ARGUMENT for a method this engine has no proposer for.
  Status check_speculation(const SpeculationParams& p) const;
  void forget_drafts(const SessionId& id) {  // a session is gone: so is the proposers' state of it
    proposer->forget(id);
    if (draft) draft->forget(id);
  }
  // Moves s's pages to the host tier (as many leading pages as it has room for, dropping the
  // least recently stored copies of other sessions first) and empties its cache; without a tier,
  // or if the copy fails, the pages are only dropped.
  void offload(Session& s, const std::set<Session*>& keep = {});
  // Copies s's host copy back after its cache (which must end at a page boundary), up to the
  // history's last position (computed for its logits), into at most `spare` new pages; the
  // positions restored. The copy goes once the cache holds it all, or when it is of no more use.
  int64_t restore(Session& s, int64_t spare);
  // At start: prefill time against copy time per token; drops the tier when it does not pay.
  Status calibrate_host_tier();
  void finish(Session& s, FinishKind kind, Status status,
              std::vector<std::pair<EventSink, GenerateEvent>>& out);
  // A generated token joins s's history and its request's output (the journal, the event, the
  // stop checks); true when it ended the request.
  bool emit(Session& s, int32_t token, std::vector<std::pair<EventSink, GenerateEvent>>& out);
  // The outcome of a speculative step for s: `tokens` (its history's last and the drafts) gave
  // output rows from `row` on (token_ids where the runner picked them, else logits): the drafts
  // the model agrees with and the token after them are emitted, the rejected drafts' positions
  // dropped from the cache.
  void verify(Session& s, std::span<const int32_t> tokens, int64_t row, bool have_ids,
              std::vector<std::pair<EventSink, GenerateEvent>>& out);
};

StatusOr<std::unique_ptr<Session>> Engine::Impl::session_from(SessionRecord r, const std::string& what) {
  const std::string at = what + r.id + ": ";
  const int n_vocab = model->config().n_vocab;
  if (r.id.size() != 32 || r.id.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return invalid_argument_error(at + "the id is not 32 hex digits");
  }
  if (sessions.count(r.id)) return Status(StatusCode::kAlreadyExists, at + "a session with this id exists");
  for (int32_t t : r.history) {
    if (t < 0 || t >= n_vocab) return invalid_argument_error(at + "token " + std::to_string(t) + " is outside the vocabulary");
  }
  if (Status v = validate(r.sampling, n_vocab); !v.ok()) return invalid_argument_error(at + v.message());
  if (r.max_context < 0) return invalid_argument_error(at + "a negative max_context");
  auto s = std::make_unique<Session>();
  s->id = r.id;
  s->parent = r.parent;
  s->options.sampling = r.sampling;
  s->options.max_context = r.max_context;
  s->options.cache_namespace = r.cache_namespace;
  s->options.owner = r.owner;
  s->max_context = r.max_context > 0 ? std::min(r.max_context, options.max_context) : options.max_context;
  if (static_cast<int64_t>(r.history.size()) > s->max_context) {
    return invalid_argument_error(at + std::to_string(r.history.size()) + " tokens exceed its context of " +
                                  std::to_string(s->max_context));
  }
  s->history = std::move(r.history);
  s->conversation = r.conversation.is_array() ? std::move(r.conversation) : nlohmann::ordered_json::array();
  COMBS_ASSIGN_OR_RETURN(s->cache, PagedKVCache::create(*pool, s->max_context));
  if (prefix) s->chain_root = prefix->chain_root(model_fingerprint, s->options.cache_namespace);
  s->last_used = Clock::now();
  if (r.last_used_unix_ms > 0) {  // it keeps the time to live it had left (expired: swept at once)
    const auto since = std::chrono::system_clock::now() -
                       std::chrono::system_clock::time_point(std::chrono::milliseconds(r.last_used_unix_ms));
    if (since > since.zero()) s->last_used -= std::chrono::duration_cast<Clock::duration>(since);
  }
  return s;
}

Status Engine::Impl::calibrate_host_tier() {
  // A prefill of a few chunks' positions, the second of two (the first warms the kernels up),
  // against storing the same positions' pages to the host and loading them back.
  const int ps = pool->page_size();
  const int64_t cap = std::min({pool->num_pages(), host->num_pages(), int64_t{16}}) * ps;
  const int64_t n = std::min({int64_t{256}, cap, options.max_context});
  if (n < 2) return ok_status();  // too small to measure: keep the tier
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  const int32_t V = model->config().n_vocab;
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 1) % V);
  COMBS_ASSIGN_OR_RETURN(std::unique_ptr<PagedKVCache> cache, PagedKVCache::create(*pool, n));
  double prefill_s = 0.0;
  for (int round = 0; round < 2; ++round) {
    cache->reset();
    const SequenceInput in{cache.get(), tokens};
    const auto t0 = Clock::now();
    COMBS_RETURN_IF_ERROR(runner->forward({&in, 1}, logits.data()));
    prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  std::vector<int32_t> device_pages(cache->page_table().begin(), cache->page_table().end());
  std::vector<int32_t> host_pages;
  for (size_t i = 0; i < device_pages.size(); ++i) host_pages.push_back(*host->alloc());  // free at start
  double copy_s = 0.0;
  Status st;
  for (int round = 0; round < 2 && st.ok(); ++round) {
    const auto t0 = Clock::now();
    st = host->store(device_pages, host_pages);
    if (st.ok()) st = host->load(host_pages, device_pages);
    copy_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  for (int32_t p : host_pages) host->release(p);
  COMBS_RETURN_IF_ERROR(st);
  counts.host_prefill_us_per_token = prefill_s * 1e6 / static_cast<double>(n);
  counts.host_copy_us_per_token = copy_s * 1e6 / static_cast<double>(n);
  if (counts.host_copy_us_per_token >= counts.host_prefill_us_per_token) host.reset();  // recomputing is cheaper
  return ok_status();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StatusOr<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<Model> model, EngineOptions o) {
  if (model == nullptr) return invalid_argument_error("engine: no model");
  if (o.page_size < 1 || o.prefill_chunk < 1 || o.step_token_budget < 1 || o.max_sessions < 1 ||
      o.max_tokens_per_request < 0) {
    return invalid_argument_error("engine: page_size, prefill_chunk, step_token_budget and max_sessions must be >= 1");
  }
  if (o.window_rollback < 0) return invalid_argument_error("engine: window_rollback must be >= 0");
  if (!(o.kv_memory_fraction >= 0.0 && o.kv_memory_fraction <= 1.0)) {
    return invalid_argument_error("engine: kv_memory_fraction must be in [0, 1]");
  }
  COMBS_RETURN_IF_ERROR(validate(o.speculation));
  auto impl = std::make_unique<Impl>(o);
  const ModelConfig& c = model->config();
  if (impl->options.max_context <= 0) impl->options.max_context = c.context_length;
  if (auto t = Tokenizer::from_gguf(model->file()); t.ok() && (*t)->n_vocab() == c.n_vocab) {
    impl->tokenizer = std::move(t).value();
  }
  {  // the chat template: the option's, else the file's; chat() says why where there is none
    std::string source = o.chat_template;
    if (source.empty() && model->file().find("tokenizer.chat_template")) {
      if (auto t = model->file().get_string("tokenizer.chat_template"); t.ok()) source = *t;
    }
    if (source.empty()) {
      impl->no_chat_template = "chat: the model has no chat template (tokenizer.chat_template); give one "
                               "(combs-server --chat-template FILE, combs-mkmodel --chat-template FILE)";
    } else if (auto t = jinja::Template::parse(source); t.ok()) {
      impl->chat_template = std::move(t).value();
    } else {
      impl->no_chat_template = "chat: the chat template does not parse: " + t.status().message();
    }
  }
  impl->model = std::move(model);
  if (o.make_runner) {
    COMBS_ASSIGN_OR_RETURN(impl->runner, o.make_runner(*impl->model));
  } else {
    COMBS_ASSIGN_OR_RETURN(impl->runner,
                           Runner::create(*impl->model, impl->backend, RunnerOptions{.batch_invariant = true}));
  }
  if (o.draft_model) {  // before the KV pool takes its share of the device's free memory
    DraftModel::MakeRunner make = o.make_runner;
    if (!make) {
      CpuBackend& backend = impl->backend;
      make = [&backend](const Model& m) -> StatusOr<std::unique_ptr<ModelRunner>> {
        COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Runner> r, Runner::create(m, backend, RunnerOptions{.batch_invariant = true}));
        return std::unique_ptr<ModelRunner>(std::move(r));
      };
    }
    DraftModelOptions d{.kv_memory_bytes = o.draft_kv_memory_bytes, .page_size = o.page_size, .kv_dtype = o.kv_dtype};
    COMBS_ASSIGN_OR_RETURN(impl->draft, DraftModel::create(o.draft_model, *impl->model, make, d));
  }
  COMBS_RETURN_IF_ERROR(impl->check_speculation(o.speculation));
  int64_t kv_bytes = o.kv_memory_bytes;
  if (o.kv_memory_fraction > 0.0) {
    if (auto free = impl->runner->backend().free_memory_bytes()) {
      kv_bytes = static_cast<int64_t>(static_cast<double>(*free) * o.kv_memory_fraction);
    }
  }
  // (A budget is each device's: a pool split over n devices holds n times the pages.)
  PagePoolOptions po{c.kv_geometry(o.kv_dtype), o.page_size,
                     pages_for_budget(c.kv_geometry(o.kv_dtype), o.page_size, kv_bytes * impl->runner->kv_shards())};
  COMBS_ASSIGN_OR_RETURN(impl->pool, impl->runner->make_page_pool(po));
  if (o.host_kv_memory_bytes < 0) return invalid_argument_error("engine: host_kv_memory_bytes must be >= 0");
  if (o.host_kv_memory_bytes > 0) {
    const int64_t pages = o.host_kv_memory_bytes / page_bytes(po.geometry, po.page_size);
    COMBS_ASSIGN_OR_RETURN(impl->host, HostPagePool::create(*impl->pool, pages));
    impl->logits.resize(c.n_vocab);
    if (o.host_kv_restore == EngineOptions::HostRestore::kAuto) COMBS_RETURN_IF_ERROR(impl->calibrate_host_tier());
  }
  impl->model_fingerprint = to_hex(impl->model->file().fingerprint());
  if (o.prefix_cache) impl->prefix = std::make_unique<PrefixCache>(*impl->pool);
  if (o.release_behind_window) impl->release_window = c.widest_window();
  for (SessionRecord& r : impl->options.restore) {  // a journal's sessions: histories, no pages
    if (static_cast<int>(impl->sessions.size()) >= impl->options.max_sessions) {
      return resource_exhausted_error("restoring session " + r.id + ": more sessions than --max-sessions " +
                                      std::to_string(impl->options.max_sessions));
    }
    COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, impl->session_from(std::move(r), "restoring session "));
    impl->sessions.emplace(s->id, std::move(s));
  }
  impl->options.restore.clear();
  impl->logits.resize(c.n_vocab);
  impl->proposer = o.proposer ? o.proposer : std::make_shared<NgramProposer>();
  Impl* raw = impl.get();
  impl->scheduler = std::thread([raw] { raw->run(); });
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::~Engine() {
  std::vector<std::pair<EventSink, GenerateEvent>> events;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->scheduler.join();
  for (auto& [id, s] : impl_->sessions) {
    if (s->active) impl_->finish(*s, FinishKind::kError, Status(StatusCode::kUnavailable, "engine shutting down"), events);
  }
  for (auto& [sink, e] : events) sink(e);
  impl_->sessions.clear();  // caches go before the pool
}

const Model& Engine::model() const { return *impl_->model; }
int64_t Engine::max_context() const { return impl_->options.max_context; }
int Engine::max_tokens_per_request() const { return impl_->options.max_tokens_per_request; }
int64_t Engine::kv_capacity_tokens() const { return impl_->pool->num_pages() * impl_->pool->page_size(); }
bool Engine::releases_behind_window() const { return impl_->release_window > 0; }

StatusOr<SessionId> Engine::create_session(const SessionOptions& options) {
  COMBS_RETURN_IF_ERROR(validate(options.sampling, impl_->model->config().n_vocab));
  if (options.speculation) COMBS_RETURN_IF_ERROR(impl_->check_speculation(*options.speculation));
  if (options.max_context < 0) return invalid_argument_error("session: max_context must be >= 0");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (static_cast<int>(impl_->sessions.size()) >= impl_->options.max_sessions) {
    return resource_exhausted_error("engine: the limit of " + std::to_string(impl_->options.max_sessions) + " sessions is reached");
  }
  auto s = std::make_unique<Session>();
  s->id = random_id();
  s->options = options;
  s->max_context = options.max_context > 0 ? std::min(options.max_context, impl_->options.max_context)
                                           : impl_->options.max_context;
  COMBS_ASSIGN_OR_RETURN(s->cache, PagedKVCache::create(*impl_->pool, s->max_context));
  if (impl_->prefix) s->chain_root = impl_->prefix->chain_root(impl_->model_fingerprint, options.cache_namespace);
  s->last_used = Clock::now();
  if (impl_->options.journal) impl_->options.journal->put(record_of(*s));
  SessionId id = s->id;
  impl_->sessions.emplace(id, std::move(s));
  return id;
}

StatusOr<std::shared_ptr<GenerateHandle>> Engine::generate(const SessionId& id, GenerateRequest request,
                                                           EventSink sink) {
  const ModelConfig& c = impl_->model->config();
  for (int32_t t : request.input) {
    if (t < 0 || t >= c.n_vocab) {
      return invalid_argument_error("generate: token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                    std::to_string(c.n_vocab) + ")");
    }
  }
  COMBS_RETURN_IF_ERROR(impl_->check_request("generate", request.max_tokens, request.stop_strings, sink));
  if (!request.stop_strings.empty() && !impl_->tokenizer) {
    return invalid_argument_error("generate: stop strings need a model with a tokenizer");
  }
  std::unique_lock<std::mutex> lock(impl_->mu);
  COMBS_ASSIGN_OR_RETURN(Session * s, impl_->idle(id));
  auto handle = impl_->start(s, std::move(request), std::move(sink), std::make_unique<Active>());
  if (!handle.ok()) return handle.status();
  s->chat_text_valid = false;  // the history is no longer a chat's rendering
  lock.unlock();
  impl_->wake.notify_all();
  return handle;
}

StatusOr<std::shared_ptr<GenerateHandle>> Engine::Impl::start(Session* s, GenerateRequest request, EventSink sink,
                                                              std::unique_ptr<Active> a) {
  const ModelConfig& c = model->config();
  const SamplingParams params = request.sampling.value_or(s->options.sampling);
  COMBS_RETURN_IF_ERROR(validate(params, c.n_vocab));
  const int64_t after = static_cast<int64_t>(s->history.size() + request.input.size()) + request.max_tokens;
  if (after > s->max_context) {
    return resource_exhausted_error("generate: " + std::to_string(after) + " tokens would exceed the session's context of " +
                                    std::to_string(s->max_context));
  }
  if (s->history.empty() && request.input.empty()) {
    return invalid_argument_error("generate: the session is empty and the request has no input");
  }
  const SpeculationParams spec = request.speculation.value_or(s->options.speculation.value_or(options.speculation));
  COMBS_RETURN_IF_ERROR(check_speculation(spec));
  a->handle = std::make_shared<GenerateHandle>();
  a->sink = std::move(sink);
  a->sampler = std::make_unique<Sampler>(params);
  a->speculation = spec;
  if (spec.method != SpeculationParams::Method::kOff) {
    // What a session learned of its drafts' acceptance and cost carries over to its next requests
    // of the same speculation (a chat's turns, an agent's steps).
    if (!s->draft_length || s->draft_for.method != spec.method || s->draft_for.max_draft != spec.max_draft) {
      s->draft_length.emplace(spec.max_draft);
      s->draft_for = spec;
    }
    a->draft_length = &*s->draft_length;
  }
  a->stop.max_tokens = request.max_tokens;
  a->stop.stop_sequences = request.stop_sequences;
  if (!request.ignore_eos && tokenizer) a->stop.eos_ids = tokenizer->end_of_generation();
  if (tokenizer) a->text = std::make_unique<StreamDecoder>(*tokenizer);
  a->usage.input_tokens = static_cast<int64_t>(request.input.size());
  a->history_before = s->history.size();
  s->history.insert(s->history.end(), request.input.begin(), request.input.end());
  if (options.journal && !request.input.empty()) {
    options.journal->append(s->id, static_cast<int64_t>(a->history_before), request.input);
  }
  // Sampling needs the last position's logits: recompute it when the cache already holds it.
  const int64_t len = static_cast<int64_t>(s->history.size());
  truncate_cache(*s, len - 1);
  a->request = std::move(request);
  auto handle = a->handle;
  snapshot(*s);
  s->active = std::move(a);
  s->last_used = Clock::now();
  ++s->edits;
  return handle;
}

namespace {
// Text content only: each message an object with a string role and a string content (other keys,
// which templates may read, pass through).
Status check_messages(const nlohmann::ordered_json& messages) {
  if (!messages.is_array()) return invalid_argument_error("chat: messages must be a JSON array");
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    const std::string at = "chat: message " + std::to_string(i);
    if (!m.is_object()) return invalid_argument_error(at + " is not an object");
    if (!m.contains("role") || !m["role"].is_string() || m["role"].get<std::string>().empty()) {
      return invalid_argument_error(at + " has no role (a non-empty string)");
    }
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null()) {
      return invalid_argument_error(at + ": content must be text (a string)");
    }
  }
  return ok_status();
}
}  // namespace

StatusOr<std::shared_ptr<GenerateHandle>> Engine::chat(const SessionId& id, ChatRequest request, EventSink sink) {
  Impl& m = *impl_;
  if (!m.tokenizer) return failed_precondition_error("chat: the model has no tokenizer");
  if (!m.chat_template) return failed_precondition_error(m.no_chat_template);
  COMBS_RETURN_IF_ERROR(check_messages(request.messages));
  if (!request.variables.is_object()) return invalid_argument_error("chat: variables must be a JSON object");
  COMBS_RETURN_IF_ERROR(m.check_request("chat", request.max_tokens, request.stop_strings, sink));
  // The conversation and what the history renders to, as they are now.
  nlohmann::ordered_json conversation;
  std::string before;
  bool before_valid;
  uint64_t edits;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    COMBS_ASSIGN_OR_RETURN(Session * s, m.idle(id));
    conversation = request.replace ? nlohmann::ordered_json::array() : s->conversation;
    before = s->chat_text;
    before_valid = s->chat_text_valid;
    edits = s->edits;
  }
  for (const auto& msg : request.messages) conversation.push_back(msg);
  // Rendering and tokenizing run outside the lock (the scheduler's steps do not wait for them).
  COMBS_ASSIGN_OR_RETURN(const std::string text, m.render(conversation, request.variables));
  // The template's text spells its special tokens; nothing is added around it (as Hugging Face's
  // apply_chat_template tokenizes).
  const bool extends = before_valid && text.size() >= before.size() && text.compare(0, before.size(), before) == 0;
  const std::vector<int32_t> tokens =
      m.tokenizer->encode(extends ? std::string_view(text).substr(before.size()) : std::string_view(text), {false, true});

  std::unique_lock<std::mutex> lock(m.mu);
  COMBS_ASSIGN_OR_RETURN(Session * s, m.idle(id));
  if (s->edits != edits) return failed_precondition_error("chat: session " + id + " changed while the turn was prepared");
  GenerateRequest g;
  size_t keep = s->history.size();
  if (extends) {
    g.input = tokens;
  } else {  // the longest common prefix of the new tokens and the history stays
    keep = 0;
    while (keep < s->history.size() && keep < tokens.size() && s->history[keep] == tokens[keep]) ++keep;
    if (keep == tokens.size() && keep > 0) --keep;  // at least one position to compute the next token from
    g.input.assign(tokens.begin() + static_cast<ptrdiff_t>(keep), tokens.end());
  }
  const int64_t after = static_cast<int64_t>(keep + g.input.size()) + request.max_tokens;
  if (after > s->max_context) {
    return resource_exhausted_error("chat: " + std::to_string(after) + " tokens would exceed the session's context of " +
                                    std::to_string(s->max_context));
  }
  COMBS_RETURN_IF_ERROR(validate(request.sampling.value_or(s->options.sampling), m.model->config().n_vocab));
  if (keep < s->history.size()) {  // roll back to where the rendering changes
    s->history.resize(keep);
    m.truncate_cache(*s, static_cast<int64_t>(keep));
    m.trim_chain(*s);
    s->host.trim(static_cast<int64_t>(keep));
    if (m.options.journal) m.options.journal->truncate(s->id, static_cast<int64_t>(keep));
    s->chat_text_valid = false;
    ++s->edits;
  }
  g.max_tokens = request.max_tokens;
  g.sampling = request.sampling;
  g.stop_strings = std::move(request.stop_strings);
  g.ignore_eos = request.ignore_eos;
  auto a = std::make_unique<Active>();
  a->chat_conversation = std::move(conversation);
  a->chat_rendering = text;
  auto handle = m.start(s, std::move(g), std::move(sink), std::move(a));
  if (!handle.ok()) return handle.status();
  lock.unlock();
  m.wake.notify_all();
  return handle;
}

bool Engine::has_chat_template() const { return impl_->chat_template.has_value(); }

StatusOr<std::string> Engine::Impl::render(const nlohmann::ordered_json& conversation,
                                           const nlohmann::ordered_json& variables) const {
  nlohmann::ordered_json context = variables;
  context["messages"] = conversation;
  context["add_generation_prompt"] = true;
  auto token_text = [&](int32_t t) { return t >= 0 ? tokenizer->token_text(t) : std::string(); };
  if (!context.contains("bos_token")) context["bos_token"] = token_text(tokenizer->bos_id());
  if (!context.contains("eos_token")) context["eos_token"] = token_text(tokenizer->eos_id());
  auto rendered = chat_template->render(context);
  if (!rendered.ok()) return invalid_argument_error("chat template: " + rendered.status().message());
  return rendered;
}

StatusOr<std::vector<int32_t>> Engine::render_chat(const nlohmann::ordered_json& messages,
                                                   const nlohmann::ordered_json& variables) const {
  const Impl& m = *impl_;
  if (!m.tokenizer) return failed_precondition_error("chat: the model has no tokenizer");
  if (!m.chat_template) return failed_precondition_error(m.no_chat_template);
  COMBS_RETURN_IF_ERROR(check_messages(messages));
  if (!variables.is_object()) return invalid_argument_error("chat: variables must be a JSON object");
  COMBS_ASSIGN_OR_RETURN(const std::string text, m.render(messages, variables));
  return m.tokenizer->encode(text, {false, true});
}

StatusOr<nlohmann::ordered_json> Engine::conversation(const SessionId& id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Session* s = impl_->find(id);
  if (s == nullptr) return not_found_error("session " + id + " not found");
  return s->conversation;
}

StatusOr<int64_t> Engine::rollback(const SessionId& id, int64_t n) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  COMBS_ASSIGN_OR_RETURN(Session * s, impl_->idle(id));
  const int64_t len = static_cast<int64_t>(s->history.size());
  if (n < 0) return invalid_argument_error("rollback: n must be >= 0");
  if (n > len) {
    return out_of_range_error("rollback: " + std::to_string(n) + " tokens asked, the session holds " + std::to_string(len));
  }
  s->history.resize(len - n);
  impl_->truncate_cache(*s, len - n);
  impl_->trim_chain(*s);
  s->host.trim(len - n);
  if (impl_->options.journal && n > 0) impl_->options.journal->truncate(s->id, len - n);
  s->last_used = Clock::now();
  if (n > 0) {
    s->chat_text_valid = false;
    ++s->edits;
  }
  return len - n;
}

Status Engine::reset(const SessionId& id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  COMBS_ASSIGN_OR_RETURN(Session * s, impl_->idle(id));
  s->history.clear();
  s->cache->reset();
  s->chain.clear();
  s->host.clear();
  if (impl_->options.journal) {
    impl_->options.journal->truncate(s->id, 0);
    impl_->options.journal->set_conversation(s->id, nlohmann::ordered_json::array());
  }
  s->conversation = nlohmann::ordered_json::array();
  s->chat_text.clear();
  s->chat_text_valid = false;
  ++s->edits;
  s->last_used = Clock::now();
  return ok_status();
}

StatusOr<SessionId> Engine::fork(const SessionId& id) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  // Copies on the device (the partly filled page, an eviction's move to the host tier) wait for a
  // forward in progress: they share its stream, which may be capturing a CUDA graph.
  impl_->forward_done.wait(lock, [&] { return !impl_->in_forward; });
  COMBS_ASSIGN_OR_RETURN(Session * s, impl_->idle(id));
  if (static_cast<int>(impl_->sessions.size()) >= impl_->options.max_sessions) {
    return resource_exhausted_error("fork: the limit of " + std::to_string(impl_->options.max_sessions) + " sessions is reached");
  }
  auto forked = s->cache->fork();
  while (!forked.ok() && forked.status().code() == StatusCode::kResourceExhausted &&
         impl_->evict_one_idle({s})) {
    forked = s->cache->fork();
  }
  if (!forked.ok()) return forked.status();
  auto child = std::make_unique<Session>();
  child->id = random_id(std::string_view(s->id).substr(0, 16));
  child->options = s->options;
  child->max_context = s->max_context;
  child->history = s->history;
  child->conversation = s->conversation;
  child->chat_text = s->chat_text;
  child->chat_text_valid = s->chat_text_valid;
  child->chain_root = s->chain_root;
  child->chain = s->chain;
  child->host.share(s->host);
  child->parent = s->id;
  if (impl_->options.journal) impl_->options.journal->put(record_of(*child));
  child->cache = std::move(forked).value();
  child->last_used = s->last_used = Clock::now();
  SessionId cid = child->id;
  impl_->sessions.emplace(cid, std::move(child));
  impl_->proposer->fork(s->id, cid);
  if (impl_->draft) impl_->draft->fork(s->id, cid);
  return cid;
}

Status Engine::close(const SessionId& id) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Session* s = impl_->find(id);
    if (s == nullptr) return not_found_error("session " + id + " not found");
    if (s->active) {
      // The scheduler owns a running request's events: it ends it (after the events already on
      // their way) and erases the session.
      s->active->handle->cancel();
      s->closing = true;
    } else {
      impl_->forget_drafts(id);
      impl_->sessions.erase(id);
      if (impl_->options.journal) impl_->options.journal->erase(id);
    }
  }
  impl_->wake.notify_all();  // pages came free, or a request is to be ended
  return ok_status();
}

StatusOr<std::string> Engine::export_session(const SessionId& id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  COMBS_ASSIGN_OR_RETURN(Session * s, impl_->idle(id));
  return encode_session(record_of(*s), impl_->model_fingerprint);
}

StatusOr<SessionId> Engine::import_session(std::string_view blob, const std::string& owner, const std::string& cache_namespace) {
  COMBS_ASSIGN_OR_RETURN(SessionRecord r, decode_session(blob, impl_->model_fingerprint));
  r.owner = owner;
  r.cache_namespace = cache_namespace;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (static_cast<int>(impl_->sessions.size()) >= impl_->options.max_sessions) {
    return resource_exhausted_error("import: the limit of " + std::to_string(impl_->options.max_sessions) + " sessions is reached");
  }
  COMBS_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, impl_->session_from(std::move(r), "import: session "));
  if (impl_->options.journal) impl_->options.journal->put(record_of(*s));
  SessionId id = s->id;
  impl_->sessions.emplace(id, std::move(s));
  return id;
}

namespace {
SessionInfo info_of(const Session& s) {
  SessionInfo i;
  i.id = s.id;
  i.length = static_cast<int64_t>(s.history.size());
  i.generating = s.active != nullptr;
  i.sampling = s.options.sampling;
  i.owner = s.options.owner;
  i.parent = s.parent;
  i.drafted_tokens = s.drafted;
  i.accepted_tokens = s.accepted;
  if (i.generating) {  // as of the last step
    i.cached = s.snap_cached;
    i.pages_held = s.snap_pages;
    i.pages_shared = s.snap_shared;
  } else {
    i.cached = s.cache->seq_len();
    i.pages_held = *s.cache->pages_used();
    i.pages_shared = s.cache->pages_shared();
  }
  return i;
}
}  // namespace

StatusOr<SessionInfo> Engine::info(const SessionId& id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Session* s = impl_->find(id);
  if (s == nullptr) return not_found_error("session " + id + " not found");
  return info_of(*s);
}

std::vector<SessionInfo> Engine::list() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<SessionInfo> out;
  for (auto& [id, s] : impl_->sessions)
    if (!s->closing) out.push_back(info_of(*s));
  return out;
}

Status Engine::runner_health() const { return impl_->runner->health(); }

EngineStats Engine::stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  EngineStats st = impl_->counts;
  for (auto& [id, s] : impl_->sessions) {
    st.sessions += s->closing ? 0 : 1;
    st.generating += s->active != nullptr;
  }
  st.pages_total = impl_->pool->num_pages();
  st.pages_free = impl_->pool->num_free();
  st.pages_used = impl_->pool->num_used();
  st.pages_cached = impl_->pool->num_cached();
  st.pages_reclaimable = impl_->pool->num_reclaimable();
  st.cached_pages_reclaimed = impl_->pool->num_reclaimed();
  if (impl_->host) {
    st.host_pages_total = impl_->host->num_pages();
    st.host_pages_used = impl_->host->num_used();
  }
  st.host_tier_active = impl_->host != nullptr;
  if (impl_->draft) {
    const DraftModelStats d = impl_->draft->stats();
    st.draft_forwards = d.forwards;
    st.draft_sessions = d.sessions;
    st.draft_cache_evictions = d.evictions;
  }
  return st;
}

void Engine::abort_generating(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->abort = why;
  }
  impl_->wake.notify_all();
}

Status Engine::check_invariants() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->forward_done.wait(lock, [&] { return !impl_->in_forward; });
  Impl& m = *impl_;
  PagePool& pool = *m.pool;
  auto pool_lock = pool.bookkeeping_lock();
  std::map<int32_t, int32_t> holders;  // page -> sessions holding it
  const int ps = pool.page_size();
  for (auto& [id, s] : m.sessions) {
    std::span<const int32_t> table = s->cache->page_table();
    const int64_t first_held = s->cache->first_held_position() / ps;
    for (int64_t i = 0; i < static_cast<int64_t>(table.size()); ++i) {
      if ((i < first_held) != (table[i] == pool.zero_page())) {
        return internal_error("session " + id + ": page " + std::to_string(i) + " is " +
                              (i < first_held ? "released but names a page" : "held but names the zero page"));
      }
      if (i >= first_held) ++holders[table[i]];
    }
    const int64_t cached = s->cache->seq_len();
    if (cached > static_cast<int64_t>(s->history.size())) {
      return internal_error("session " + id + " caches more positions than its history holds");
    }
    if (s->chain.size() > s->history.size() / ps) return internal_error("session " + id + " has keys of pages it lost");
    Digest prev = s->chain_root;
    for (size_t i = 0; i < s->chain.size(); ++i) {
      prev = PrefixCache::chain_next(prev, {s->history.data() + i * ps, static_cast<size_t>(ps)});
      if (prev != s->chain[i]) return internal_error("session " + id + ": the key of page " + std::to_string(i) + " is stale");
    }
    if (!m.prefix) continue;
    for (int64_t i = first_held; i < cached / ps; ++i) {  // a cached page holds what its key says
      if (auto key = m.prefix->key_of(table[i]); key && *key != m.page_key(*s, i)) {
        return internal_error("session " + id + ": page " + std::to_string(i) + " is cached under another prefix's key");
      }
    }
  }
  int64_t reclaimable = 0, used = static_cast<int64_t>(holders.size());
  for (int32_t p = 0; p < pool.num_pages(); ++p) {
    const auto it = holders.find(p);
    const int32_t held = it == holders.end() ? 0 : it->second;
    const bool cached = pool.is_cached(p);
    if (pool.refcount(p) != held + (cached ? 1 : 0)) {
      return internal_error("page " + std::to_string(p) + " has " + std::to_string(pool.refcount(p)) + " references, " +
                            std::to_string(held) + " sessions hold it" + (cached ? " and it is cached" : ""));
    }
    if (cached && held == 0) ++reclaimable, ++used;
  }
  if (used != pool.num_used()) {
    return internal_error("pages in use " + std::to_string(pool.num_used()) + " != distinct pages held or cached " +
                          std::to_string(used));
  }
  if (reclaimable != pool.num_reclaimable()) {
    return internal_error("reclaimable pages " + std::to_string(pool.num_reclaimable()) + " != cached pages no session holds " +
                          std::to_string(reclaimable));
  }
  if (m.prefix && !m.prefix->consistent()) return internal_error("the prefix cache's index and the pool's marks differ");
  // The host tier: every host page's count is the sessions sharing it; copies within histories.
  std::map<int32_t, int32_t> host_holders;
  for (auto& [id, s] : m.sessions) {
    if (s->host.len() > static_cast<int64_t>(s->history.size())) {
      return internal_error("session " + id + "'s host copy holds more positions than its history");
    }
    if (static_cast<int64_t>(s->host.pages().size()) != pages_for_tokens(s->host.len(), ps)) {
      return internal_error("session " + id + "'s host copy has pages beyond its positions");
    }
    if (!s->host.empty() && !m.host) return internal_error("session " + id + " has a host copy without a host tier");
    for (int32_t p : s->host.pages()) ++host_holders[p];
  }
  if (m.host) {
    for (int32_t p = 0; p < m.host->num_pages(); ++p) {
      const auto it = host_holders.find(p);
      const int32_t held = it == host_holders.end() ? 0 : it->second;
      if (m.host->refcount(p) != held) {
        return internal_error("host page " + std::to_string(p) + " has " + std::to_string(m.host->refcount(p)) +
                              " references, " + std::to_string(held) + " sessions hold it");
      }
    }
    if (m.host->num_used() != static_cast<int64_t>(host_holders.size())) {
      return internal_error("host pages in use " + std::to_string(m.host->num_used()) + " != distinct pages held " +
                            std::to_string(host_holders.size()));
    }
  }
  if (!m.prefix && pool.num_cached() != 0) return internal_error("pages are cached with the prefix cache off");
  return ok_status();
}

// ---- The scheduler ----

void Engine::Impl::finish(Session& s, FinishKind kind, Status status,
                          std::vector<std::pair<EventSink, GenerateEvent>>& out) {
  Active& a = *s.active;
  GenerateEvent e;
  e.type = GenerateEvent::Type::kFinished;
  if (a.text) e.text = a.text->finish();  // bytes held back for an unfinished character
  e.finish = kind;
  e.status = std::move(status);
  e.usage = a.usage;
  e.usage.output_tokens = static_cast<int64_t>(a.generated.size());
  out.emplace_back(a.sink, std::move(e));
  if (kind == FinishKind::kError) {  // undo the request: its input and any tokens it generated
    s.history.resize(a.history_before);
    truncate_cache(s, static_cast<int64_t>(a.history_before));
    trim_chain(s);
    s.host.trim(static_cast<int64_t>(a.history_before));
    if (options.journal) options.journal->truncate(s.id, static_cast<int64_t>(a.history_before));
  }
  if (a.chat_conversation && kind != FinishKind::kError) {  // the reply joins the conversation
    std::vector<int32_t> reply = a.generated;
    if (kind == FinishKind::kEos && !reply.empty()) reply.pop_back();
    std::string spelled = a.chat_rendering;  // the text the history now is the tokens of
    for (int32_t t : a.generated) spelled += tokenizer->piece(t, /*render_special=*/true);
    a.chat_conversation->push_back({{"role", "assistant"}, {"content", tokenizer->decode(reply)}});
    s.conversation = std::move(*a.chat_conversation);
    if (options.journal) options.journal->set_conversation(s.id, s.conversation);
    s.chat_text = std::move(spelled);
    s.chat_text_valid = true;
  }
  ++s.edits;
  out.back().second.session_length = static_cast<int64_t>(s.history.size());
  s.active.reset();
  s.last_used = Clock::now();
}

bool Engine::Impl::emit(Session& s, int32_t token, std::vector<std::pair<EventSink, GenerateEvent>>& out) {
  Active& a = *s.active;
  a.generated.push_back(token);
  s.history.push_back(token);
  if (options.journal) options.journal->append(s.id, static_cast<int64_t>(s.history.size()) - 1, {&token, 1});
  GenerateEvent e;
  e.token = token;
  if (a.text) e.text = a.text->push(token);
  bool stop_string = false;
  if (!a.request.stop_strings.empty()) {
    // Only the tail can hold a new match: the text this token added and what precedes it.
    const size_t before = a.generated_text.size();
    a.generated_text += e.text;
    for (const std::string& stop : a.request.stop_strings) {
      const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
      stop_string |= a.generated_text.find(stop, from) != std::string::npos;
    }
  }
  out.emplace_back(a.sink, std::move(e));
  if (stop_string) {
    finish(s, FinishKind::kStop, ok_status(), out);
    return true;
  }
  switch (check_stop(a.stop, a.generated)) {
    case FinishReason::kNone: return false;
    case FinishReason::kEos: finish(s, FinishKind::kEos, ok_status(), out); return true;
    case FinishReason::kStopSequence: finish(s, FinishKind::kStop, ok_status(), out); return true;
    case FinishReason::kLength: finish(s, FinishKind::kLength, ok_status(), out); return true;
  }
  return false;
}

void Engine::Impl::verify(Session& s, std::span<const int32_t> tokens, int64_t row, bool have_ids,
                          std::vector<std::pair<EventSink, GenerateEvent>>& out) {
  Active& a = *s.active;
  const int V = model->config().n_vocab;
  const auto d = static_cast<int64_t>(tokens.size()) - 1;  // drafted
  // Row j's output follows the history and drafts 0..j-1: the draft j it checks is accepted, or
  // the token it yields instead ends the run; after every draft accepted, one more from row d.
  std::vector<int32_t> taken;
  // The penalties' window at row j sees the drafts before it.
  const bool penalties = !have_ids && !is_plain_greedy(a.sampler->params());
  if (penalties) {
    spec_history.assign(s.history.begin(), s.history.end());
    spec_history.insert(spec_history.end(), tokens.begin() + 1, tokens.end());
  }
  int64_t accepted = 0;
  for (int64_t j = 0; j <= d; ++j) {
    std::span<float> l(logits.data() + (row + j) * V, V);
    const std::span<const int32_t> h =
        penalties ? std::span<const int32_t>(spec_history).first(s.history.size() + j) : std::span<const int32_t>(s.history);
    if (j == d) {
      taken.push_back(have_ids ? token_ids[row + j] : a.sampler->sample(l, h));
      break;
    }
    bool ok = false;
    int32_t t;
    if (have_ids) {
      t = token_ids[row + j];
      ok = t == tokens[j + 1];
    } else {
      t = a.sampler->verify(l, h, tokens[j + 1], &ok);
    }
    taken.push_back(t);
    if (!ok) break;
    ++accepted;
  }
  // The cache holds the history's last position and every draft: the rejected ones go.
  truncate_cache(s, s.cache->seq_len() - (d - accepted));
  a.draft_length->observe(static_cast<int>(d), static_cast<int>(accepted));
  a.usage.drafted_tokens += d;
  a.usage.accepted_tokens += accepted;
  s.drafted += d;
  s.accepted += accepted;
  counts.drafted_tokens += d;
  counts.accepted_tokens += accepted;
  for (int32_t t : taken) {
    if (emit(s, t, out)) break;
  }
  // A request that ended inside the run keeps no position past its history's last.
  truncate_cache(s, static_cast<int64_t>(s.history.size()) - 1);
}

void Engine::Impl::truncate_cache(Session& s, int64_t keep) {
  const int64_t len = std::min(s.cache->seq_len(), keep);
  const int64_t held = s.cache->first_held_position();  // > 0 only with a release_window
  if (held > 0 && len - release_window + 1 < held) {
    s.cache->reset();
    ++counts.window_rebuilds;
  } else if (s.cache->seq_len() > len) {
    s.cache->popn(s.cache->seq_len() - len);
  }
}

void Engine::Impl::release_behind_window(Session& s) {
  if (release_window == 0) return;
  // The next position reads keys from seq_len() - window + 1 on; a rollback of up to
  // window_rollback positions still finds its window held.
  counts.window_pages_released +=
      s.cache->release_before(s.cache->seq_len() - release_window + 1 - options.window_rollback);
}

const Digest& Engine::Impl::page_key(Session& s, int64_t i) {
  const size_t ps = static_cast<size_t>(pool->page_size());
  while (s.chain.size() <= static_cast<size_t>(i)) {
    const Digest& prev = s.chain.empty() ? s.chain_root : s.chain.back();
    s.chain.push_back(PrefixCache::chain_next(prev, {s.history.data() + s.chain.size() * ps, ps}));
  }
  return s.chain[i];
}

int64_t Engine::Impl::map_cached_prefix(Session& s, int64_t spare, bool* looked) {
  const int64_t ps = pool->page_size();
  const int64_t cached = s.cache->seq_len();
  const int64_t len = static_cast<int64_t>(s.history.size());
  if (!prefix || cached % ps != 0 || cached + ps >= len) return 0;
  *looked = true;
  // Found pages are retained before anything can reclaim them: the pool's lock across both.
  auto lock = pool->bookkeeping_lock();
  std::vector<int32_t> pages;
  for (int64_t i = cached / ps; (i + 1) * ps < len; ++i) {
    std::optional<int32_t> page = prefix->find(page_key(s, i));
    if (!page) break;
    if (pool->refcount(*page) == 1) {  // reclaimable: mapping it takes a page the step may count on
      if (spare <= 0) break;
      --spare;
    }
    pages.push_back(*page);
  }
  if (pages.empty()) return 0;
  // A whole number of pages at a boundary, within the context: cannot fail.
  s.cache->adopt_pages(pages).ignore();
  return static_cast<int64_t>(pages.size()) * ps;
}

int64_t Engine::Impl::next_page_cached(Session& s) {
  const int64_t ps = pool->page_size();
  const int64_t cached = s.cache->seq_len();
  const int64_t next = cached / ps + 1;  // the page after the partly filled one
  if (!prefix || cached % ps == 0 || (next + 1) * ps >= static_cast<int64_t>(s.history.size())) return 0;
  return prefix->find(page_key(s, next)) ? next * ps : 0;
}

void Engine::Impl::cache_filled_pages(Session& s, int64_t from, int64_t to) {
  if (!prefix) return;
  const int64_t ps = pool->page_size();
  std::span<const int32_t> table = s.cache->page_table();
  for (int64_t i = std::max(from, s.cache->first_held_position()) / ps; i < to / ps; ++i) {
    if (!pool->is_cached(table[i])) prefix->insert(page_key(s, i), table[i]);
  }
}

void Engine::Impl::propose_drafts(const std::vector<Session*>& order, StepDrafts* drafts) {
  std::vector<DraftRequest> requests[2];  // [0]: proposer's, [1]: the draft model's
  std::vector<Session*> whose[2];
  for (Session* s : order) {
    Active& a = *s->active;
    const auto len = static_cast<int64_t>(s->history.size());
    if (!a.draft_length || s->cache->seq_len() != len - 1) continue;  // not decoding, or not speculating
    drafts->before.emplace(s, *a.draft_length);
    const int64_t want = std::min<int64_t>({a.draft_length->next(), a.request.max_tokens - 1 - static_cast<int64_t>(a.generated.size()),
                                            s->max_context - len, options.step_token_budget - 1});
    if (want <= 0) continue;
    const int k = a.speculation.method == SpeculationParams::Method::kDraft ? 1 : 0;
    requests[k].push_back({s->id, s->history, static_cast<int>(want)});
    whose[k].push_back(s);
    drafts->asked.insert(s);
  }
  std::vector<std::vector<int32_t>> out;
  for (int k = 0; k < 2; ++k) {
    if (requests[k].empty()) continue;
    Proposer& p = k == 1 ? static_cast<Proposer&>(*draft) : *proposer;
    p.propose(requests[k], &out);
    for (size_t i = 0; i < whose[k].size() && i < out.size(); ++i) {
      if (static_cast<int>(out[i].size()) > requests[k][i].max) out[i].resize(static_cast<size_t>(requests[k][i].max));
      if (!out[i].empty()) drafts->tokens[whose[k][i]] = std::move(out[i]);
    }
  }
}

Status Engine::Impl::check_speculation(const SpeculationParams& p) const {
  COMBS_RETURN_IF_ERROR(validate(p));
  if (p.method == SpeculationParams::Method::kDraft && !draft) {
    return invalid_argument_error("speculation: method draft needs a draft model (combs-server --draft-model FILE)");
  }
  return ok_status();
}

bool Engine::Impl::evict_one_idle(const std::set<Session*>& keep) {
  Session* victim = nullptr;
  for (auto& [id, s] : sessions) {
    if (s->active || keep.count(s.get()) || *s->cache->pages_used() == 0) continue;
    if (victim == nullptr || s->last_used < victim->last_used) victim = s.get();
  }
  if (victim == nullptr) return false;
  offload(*victim, keep);  // the history stays: the next generate copies the pages back or rebuilds them
  ++counts.evictions;
  return true;
}

void Engine::Impl::offload(Session& s, const std::set<Session*>& keep) {
  const int64_t cached = s.cache->seq_len();
  // Nothing to keep, the host has it already, or the cache released positions behind a window (a
  // host copy holds a history's first positions on).
  if (!host || cached == 0 || s.host.len() >= cached || s.cache->first_held_position() > 0) {
    s.cache->reset();
    return;
  }
  s.host.clear();
  const int64_t want = static_cast<int64_t>(s.cache->page_table().size());
  // Room: the least recently stored copies of other idle sessions go first (they rebuild by
  // prefill).
  while (host->num_free() < want) {
    Session* oldest = nullptr;
    for (auto& [id, o] : sessions) {
      // Never the copy of a request in progress (it is about to come back) nor one of `keep`'s.
      if (o.get() != &s && !o->active && !keep.count(o.get()) && !o->host.empty() && (oldest == nullptr || o->host.stored() < oldest->host.stored())) {
        oldest = o.get();
      }
    }
    if (oldest == nullptr) break;
    oldest->host.clear();
    ++counts.host_copies_dropped;
  }
  const int64_t n = std::min(want, host->num_free());
  if (n > 0) {
    std::vector<int32_t> pages;
    for (int64_t i = 0; i < n; ++i) pages.push_back(*host->alloc());
    const std::span<const int32_t> table = s.cache->page_table().subspan(0, static_cast<size_t>(n));
    if (host->store(table, pages).ok()) {
      s.host.set(*host, std::move(pages), std::min(cached, n * pool->page_size()));
      ++counts.host_offloads;
    } else {
      for (int32_t p : pages) host->release(p);  // the pages are only dropped
    }
  }
  s.cache->reset();
}

int64_t Engine::Impl::restore(Session& s, int64_t spare) {
  if (s.host.empty()) return 0;
  const int ps = pool->page_size();
  const int64_t cached = s.cache->seq_len();
  const int64_t end = std::min(s.host.len(), static_cast<int64_t>(s.history.size()) - 1);
  if (cached % ps != 0 || end <= cached) {  // the cache went past the copy (or no longer ends where a page can follow)
    s.host.clear();
    return 0;
  }
  const int64_t first = cached / ps;
  const int64_t n = std::min(pages_for_tokens(end, ps) - first, spare);
  if (n <= 0) return 0;
  std::vector<int32_t> pages;
  {
    auto lock = pool->bookkeeping_lock();  // spare counted what alloc() can hand out
    for (int64_t i = 0; i < n; ++i) pages.push_back(*pool->alloc());
  }
  const int64_t to = std::min(end, (first + n) * ps);
  Status st = host->load(s.host.pages().subspan(static_cast<size_t>(first), static_cast<size_t>(n)), pages);
  if (st.ok()) st = s.cache->adopt_filled_pages(pages, to);
  if (!st.ok()) {  // the copy is of no use: compute the positions instead
    for (int32_t p : pages) pool->release(p);
    s.host.clear();
    return 0;
  }
  if (to == end) s.host.clear();
  ++counts.host_restores;
  counts.host_restored_tokens += to - cached;
  return to - cached;
}

void Engine::Impl::sweep_expired() {
  const auto now = Clock::now();
  for (auto it = sessions.begin(); it != sessions.end();) {
    if (!it->second->active && now - it->second->last_used > options.session_ttl) {
      if (options.journal) options.journal->erase(it->first);
      forget_drafts(it->first);
      it = sessions.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::Impl::run() {
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    sweep_expired();
    bool any_active = false;
    for (auto& [id, s] : sessions) any_active |= s->active != nullptr;
    if (!any_active) {
      counts.waiting = counts.batch_sequences = counts.batch_tokens = 0;
      abort = ok_status();  // nothing was running to abort
      wake.wait_for(lock, std::chrono::seconds(1));  // idle: no busy-waiting; wakes for work or TTL
      continue;
    }
    step(lock);
  }
}

// One step: pick work, make room, run one forward for all of it, sample, emit.
void Engine::Impl::step(std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<EventSink, GenerateEvent>> events;
  // An abort (server shutdown) ends every running request — here, on the scheduler thread, so a
  // request's events always come from one thread, in order.
  if (!abort.ok()) {
    for (auto& [id, s] : sessions)
      if (s->active) finish(*s, FinishKind::kError, abort, events);
    abort = ok_status();
  }
  // Cancelled requests end here, keeping what they generated; closed sessions go.
  for (auto it = sessions.begin(); it != sessions.end();) {
    Session& s = *it->second;
    if (s.active && s.active->handle->cancelled()) finish(s, FinishKind::kCancelled, ok_status(), events);
    if (s.closing && !s.active) {
      if (options.journal) options.journal->erase(it->first);
      forget_drafts(it->first);
      it = sessions.erase(it);
    } else {
      ++it;
    }
  }
  // Candidates, oldest activity first, so that every session gets its turn.
  std::vector<Session*> order;
  for (auto& [id, s] : sessions)
    if (s->active) order.push_back(s.get());
  std::sort(order.begin(), order.end(), [](Session* a, Session* b) { return a->last_used < b->last_used; });
  // A step's time, for the draft lengths: a step with drafts costs from before they were proposed
  // to the end of its forward, one without from after.
  const Clock::time_point step_start = Clock::now();
  StepDrafts drafts;
  propose_drafts(order, &drafts);
  const Clock::time_point drafted_at = Clock::now();

  struct Work {
    Session* s;
    int64_t from, n;  // history positions [from, from + n)
    // A speculative step's: the history's last token and the drafted ones after it (n of them),
    // with an output row each.
    std::vector<int32_t> tokens;
    bool timed = false;  // a decode step of a speculating request: its time goes to its DraftLength
  };
  std::vector<Work> work;
  std::set<Session*> chosen;
  int64_t budget = options.step_token_budget;
  int64_t reserved = 0;  // pages the work chosen so far takes
  std::set<Digest> in_flight;  // the prefix cache's keys of the first pages the chosen prefills write
  std::vector<Session*> deferred;
  for (Session* s : order) {
    const int64_t len = static_cast<int64_t>(s->history.size());
    if (s->cache->seq_len() >= len) {  // the last token's logits are needed again: recompute it
      truncate_cache(*s, len - 1);
      continue;  // next step
    }
    // A request that arrived earlier waits for pages it cannot get (it holds some): later ones take
    // none until it has moved (not even reclaimable cached ones), so that what a preemption frees
    // goes to it.
    const bool yields = page_priority && s->active->arrival > *page_priority;
    bool looked = false;
    const int64_t mapped = map_cached_prefix(*s, yields ? 0 : pool->num_available() - reserved, &looked);
    // Then what the host tier holds beyond it, into free pages or those of idle sessions.
    int64_t restored = 0;
    if (!s->host.empty() && !yields) {
      const int64_t want = pages_for_tokens(std::min(s->host.len(), len - 1), pool->page_size()) -
                           s->cache->seq_len() / pool->page_size();
      while (want > pool->num_available() - reserved && evict_one_idle(chosen)) {
      }
      const int64_t from = s->cache->seq_len();
      restored = restore(*s, pool->num_available() - reserved);
      cache_filled_pages(*s, from, from + restored);
    }
    Active& act = *s->active;
    if (!act.counted_cache) {  // positions this request need not compute
      act.usage.cached_tokens = s->cache->seq_len();
      act.counted_cache = true;
      counts.prefix_lookups += looked;
      counts.prefix_hits += mapped > 0;
    } else {
      act.usage.cached_tokens += mapped + restored;
    }
    counts.prefix_hit_tokens += mapped;
    const int64_t cached = s->cache->seq_len();
    // A session of this step computes the same page (one prompt arriving many times at once): this
    // one waits and maps that page next step instead of computing it again.
    std::optional<Digest> first_page;
    if (prefix && cached % pool->page_size() == 0 && cached + pool->page_size() < len) {
      first_page = page_key(*s, cached / pool->page_size());
      if (in_flight.count(*first_page)) continue;
    }
    // Chunk boundaries at multiples of prefill_chunk, whatever else shares the step.
    const int64_t boundary = (cached / options.prefill_chunk + 1) * options.prefill_chunk;
    int64_t n = std::min(len, boundary) - cached;
    // Mid-page with cached pages after this one (a rollback into a page): compute only to the
    // page's end, and map the rest next step.
    if (const int64_t page_end = next_page_cached(*s)) n = std::min(n, page_end - cached);
    // Decoding with speculation: drafted tokens ride along, as many as the request still wants
    // (less the token the verification itself yields), the budget and the context allow, and only
    // into pages that are free without pushing anyone out.
    std::vector<int32_t> spec_tokens;
    if (auto d = drafts.tokens.find(s); d != drafts.tokens.end() && cached == len - 1 && n == 1) {
      std::vector<int32_t>& draft = d->second;
      const int64_t room = std::min<int64_t>({act.request.max_tokens - 1 - static_cast<int64_t>(act.generated.size()),
                                              s->max_context - len, budget - 1});
      if (static_cast<int64_t>(draft.size()) > room) draft.resize(static_cast<size_t>(std::max<int64_t>(room, 0)));
      // A request that yields its pages' turn drafts only into the page its token takes anyway.
      const int64_t page_room = yields ? s->cache->pages_to_grow(cached + 1)
                                       : std::max(s->cache->pages_to_grow(cached + 1), pool->num_available() - reserved);
      const int32_t n_vocab = model->config().n_vocab;
      if (!draft.empty() && std::all_of(draft.begin(), draft.end(), [&](int32_t t) { return t >= 0 && t < n_vocab; }) &&
          s->cache->pages_to_grow(cached + 1 + static_cast<int64_t>(draft.size())) <= page_room) {
        spec_tokens.push_back(s->history.back());
        spec_tokens.insert(spec_tokens.end(), draft.begin(), draft.end());
        n = static_cast<int64_t>(spec_tokens.size());
      }
    }
    if (n > budget) {
      if (!work.empty()) continue;  // waits for a step with room
      // Alone in the step it may exceed the budget by at most one chunk.
    }
    const int64_t need = s->cache->pages_to_grow(cached + n);
    if (need > 0 && yields) {
      deferred.push_back(s);
      continue;
    }
    // Free and reclaimable cached pages first, then the pages of idle sessions, oldest first.
    while (need > pool->num_available() - reserved && evict_one_idle(chosen)) {
    }
    if (need > pool->num_available() - reserved) {
      // (It would hold its pages from the first it has not released: a session whose window
      // releases them may have a history longer than the pool.)
      const int64_t held_after = pages_for_tokens(cached + n, pool->page_size()) - s->cache->first_held_position() / pool->page_size();
      if (held_after > pool->num_pages() || options.when_full == EngineOptions::WhenFull::kFail ||
          (work.empty() && [&] {  // nothing runs and nothing else can free pages for it
            for (Session* o : order)
              if (o != s && *o->cache->pages_used() > 0) return false;
            return true;
          }())) {
        finish(*s, FinishKind::kError,
               resource_exhausted_error("no free KV pages: the request needs " + std::to_string(need) +
                                        " more pages than can be freed"),
               events);
      } else {
        deferred.push_back(s);
      }
      continue;
    }
    reserved += need;
    budget -= n;
    // Timed: a step with drafts, or a plain one its draft length chose (not one whose drafts did
    // not come or did not fit).
    const bool timed = act.draft_length && cached == len - 1 && (!spec_tokens.empty() || (n == 1 && !drafts.asked.count(s)));
    work.push_back({s, cached, n, std::move(spec_tokens), timed});
    if (first_page) in_flight.insert(*first_page);
    chosen.insert(s);
  }
  {  // Draft lengths whose decision this step does not carry out go back to before it.
    std::set<Session*> verifying;
    for (const Work& w : work)
      if (!w.tokens.empty()) verifying.insert(w.s);
    for (auto& [s, saved] : drafts.before) {
      if (s->active && (!chosen.count(s) || (drafts.asked.count(s) && !verifying.count(s)))) *s->active->draft_length = saved;
    }
  }
  counts.waiting = static_cast<int64_t>(order.size() - work.size());
  // Requests that made no progress this step: past the queue timeout they end, undone.
  const auto now = Clock::now();
  for (Session* s : order) {
    if (!s->active) continue;  // ended above
    if (chosen.count(s)) {
      s->active->waiting_since.reset();
      continue;
    }
    if (!s->active->waiting_since) s->active->waiting_since = now;
    if (options.queue_timeout.count() > 0 && now - *s->active->waiting_since >= options.queue_timeout) {
      ++counts.queue_timeouts;
      finish(*s, FinishKind::kError,
             resource_exhausted_error("the request waited " + std::to_string(options.queue_timeout.count()) +
                                      " ms without room to run (the queue timeout)"),
             events);
    }
  }
  counts.batch_sequences = static_cast<int64_t>(work.size());
  counts.batch_tokens = options.step_token_budget - budget;

  if (!work.empty()) {
    std::vector<SequenceInput> inputs;
    bool any_draft = false;
    for (const Work& w : work) {
      if (w.tokens.empty()) {
        inputs.push_back({w.s->cache.get(), {w.s->history.data() + w.from, static_cast<size_t>(w.n)}});
      } else {  // a verification: every position's output
        inputs.push_back({w.s->cache.get(), w.tokens, true});
        any_draft = true;
      }
    }
    const int V = model->config().n_vocab;
    const auto rows = static_cast<size_t>(output_rows(inputs, false));
    if (logits.size() < rows * V) logits.resize(rows * V);
    // The forward runs outside the lock: API calls go on meanwhile. The sessions in the step are
    // generating, so no call touches their history or cache (close() only marks them); calls on
    // other sessions meet the forward only in the page pool, whose bookkeeping has its own lock.
    // All greedy (the common case of benchmarks and tools): the runner picks the tokens. A runner
    // that samples on its device takes every row's sampling (each draw taken from the sequence's
    // generator here, as Sampler::sample would, and given back if the step does not happen). Either
    // way a device runner sends only the token ids to the host.
    // (A step with a sampled request's drafts takes the logits to the host: the rejection rule
    // runs there.)
    bool all_greedy = true;
    for (const Work& w : work) all_greedy &= is_plain_greedy(w.s->active->sampler->params());
    const bool device_sampling = !all_greedy && !any_draft && runner->samples_on_device();
    if (token_ids.size() < rows) token_ids.resize(rows);
    ForwardOptions fo;
    if (all_greedy || device_sampling) fo.token_ids = token_ids.data();
    if (device_sampling) {
      row_sampling.resize(work.size());
      penalized.resize(work.size());
      generator_before.resize(work.size());
      for (size_t i = 0; i < work.size(); ++i) {
        Session& s = *work[i].s;
        Sampler& sampler = *s.active->sampler;
        generator_before[i] = sampler.generator_state();
        // Only a row whose forward ends its history yields a token this step.
        const bool yields = work[i].from + work[i].n == static_cast<int64_t>(s.history.size()) &&
                            s.active->request.max_tokens != 0;
        penalized[i].clear();
        if (yields) sampler.penalized(s.history, V, &penalized[i]);
        row_sampling[i] = {&sampler.params(), yields && sampler.params().temperature > 0.0f ? sampler.uniform() : 0.0,
                           penalized[i]};
      }
      fo.sampling = std::span<const RowSampling>(row_sampling.data(), work.size());
    }
    in_forward = true;
    lock.unlock();
    Status st = runner->forward(inputs, logits.data(), fo);
    lock.lock();
    in_forward = false;
    forward_done.notify_all();
    ++counts.steps;
    counts.forward_tokens += counts.batch_tokens;
    int64_t row = 0;  // the first output row of work[i]
    // What the step did to work[i]'s session and request (its rows start at `row`).
    auto conclude = [&](size_t i, int64_t row) {
      Session& s = *work[i].s;
      Active& a = *s.active;
      if (!st.ok() && device_sampling) a.sampler->set_generator_state(generator_before[i]);  // the draw goes back
      if (st.code() == StatusCode::kResourceExhausted) return;  // pages went to a concurrent fork: next step
      if (!st.ok()) {
        finish(s, FinishKind::kError, st, events);
        return;
      }
      s.last_used = Clock::now();
      if (!work[i].tokens.empty()) {  // a verification
        verify(s, work[i].tokens, row, fo.token_ids != nullptr, events);
        cache_filled_pages(s, work[i].from, s.cache->seq_len());
        return;
      }
      a.usage.prefilled_tokens += work[i].n > 1 || a.generated.empty() ? work[i].n : 0;
      cache_filled_pages(s, work[i].from, work[i].from + work[i].n);
      if (s.cache->seq_len() < static_cast<int64_t>(s.history.size())) return;  // more prefill
      if (a.request.max_tokens == 0) {
        finish(s, FinishKind::kLength, ok_status(), events);
        return;
      }
      std::span<float> l(logits.data() + row * V, V);
      emit(s, fo.token_ids ? token_ids[row] : a.sampler->sample(l, s.history), events);
    };
    const Clock::time_point step_end = Clock::now();
    for (size_t i = 0; i < work.size(); row += work[i].tokens.empty() ? 1 : work[i].n, ++i) {
      if (st.ok() && work[i].timed) {  // (before conclude: a finished request's Active goes)
        // What the step emits for it: every accepted draft and one more, less what a stop cuts.
        Active& a = *work[i].s->active;
        const size_t before = a.generated.size();
        conclude(i, row);
        if (work[i].s->active.get() == &a) {
          const bool drafted = !work[i].tokens.empty();
          a.draft_length->observe_time(drafted ? static_cast<int>(work[i].n - 1) : 0, static_cast<int>(a.generated.size() - before),
                                       std::chrono::duration<double>(step_end - (drafted ? step_start : drafted_at)).count());
        }
      } else {
        conclude(i, row);
      }
      if (st.ok()) release_behind_window(*work[i].s);
      snapshot(*work[i].s);  // after a verification has dropped the rejected drafts
    }
  }
  // Nothing ran and requests wait for pages that only they hold among them: none can move, so the
  // most recently active one that holds pages is preempted — its pages go to the host tier, or
  // are dropped (its full ones stay in the prefix cache), it waits, and it resumes by copying them
  // back or rebuilding them (the same tokens: the runner is batch-invariant) once the others have
  // moved on. Oldest first, so every request gets through.
  if (work.empty() && !deferred.empty()) {
    Session* youngest = nullptr;  // by arrival
    for (Session* d : deferred) {
      if (d->active && *d->cache->pages_used() > 0 && (youngest == nullptr || d->active->arrival > youngest->active->arrival)) youngest = d;
    }
    if (youngest != nullptr) {
      offload(*youngest);
      ++counts.preemptions;
    }
  }
  // The earliest request left waiting with pages has the first claim on pages next step.
  page_priority.reset();
  for (Session* d : deferred) {
    if (d->active && *d->cache->pages_used() > 0 && (!page_priority || d->active->arrival < *page_priority)) {
      page_priority = d->active->arrival;
    }
  }
  lock.unlock();
  for (auto& [sink, e] : events) {
    // A finished request's last event waits for its tokens to be durable.
    if (options.journal && e.type == GenerateEvent::Type::kFinished) {
      options.journal->barrier([sink = std::move(sink), e = std::move(e)] { sink(e); });
    } else {
      sink(e);
    }
  }
  lock.lock();
}

}  // namespace combs
