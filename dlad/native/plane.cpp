// See plane.hpp.
#include "plane.hpp"

#include "chain_engine.hpp"
#include "clock.hpp"
#include "gpu_batch_engine.hpp"
#include "shm_guard.hpp"
#include "timing_engine.hpp"

#include <dlfcn.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <tuple>

namespace dlad::plane {
namespace {

constexpr int kDontWait = 1;  // ZMQ_DONTWAIT
constexpr int kSndMore = 2;   // ZMQ_SNDMORE
constexpr int kSrcFd = 2;     // ZMQ_SRCFD (zmq_msg_get): the fd a message was read from
constexpr short kPollIn = 1;  // ZMQ_POLLIN
constexpr short kPollOut = 2;  // ZMQ_POLLOUT
constexpr int kMinRefusals = 64;  // a client's refusals over its rate before silence, at least
constexpr int kBurst = 64;    // messages read in a row before engines and replies get a turn
// A probe (or a warm-up) waits for its engine however long (a hung task ends at its timeout)
constexpr int64_t kProbeDeadlineNs = 86'400'000'000'000;

// protocol.Status
enum Status : int64_t {
    OK = 0, BAD_REQUEST = 1, NOT_FOUND = 2, OVERLOADED = 3, DEADLINE_EXCEEDED = 4, CANCELLED = 5,
    SHUTTING_DOWN = 6, DEVICE_FAILED = 7, INTERNAL = 8,
};
const char* status_name(int64_t s) {
    static const char* names[] = {"OK",        "BAD_REQUEST",   "NOT_FOUND",
                                  "OVERLOADED", "DEADLINE_EXCEEDED", "CANCELLED",
                                  "SHUTTING_DOWN", "DEVICE_FAILED", "INTERNAL"};
    return s >= 0 && s <= INTERNAL ? names[s] : "INTERNAL";
}

std::string hex(const std::string& bytes) {
    static const char digits[] = "0123456789abcdef";
    std::string out;
    out.reserve(2 * bytes.size());
    for (const unsigned char c : bytes) {
        out.push_back(digits[c >> 4]);
        out.push_back(digits[c & 15]);
    }
    return out;
}

// The key of a client's request id (an INFER's, an INFER_BATCH's images').
std::string key_of(const std::string& client, uint64_t request_id) {
    std::string key = client;
    key.append(reinterpret_cast<const char*>(&request_id), sizeof request_id);
    return key;
}

std::string segment_key(const std::string& owner, const std::string& name) {
    std::string key = owner;
    key.push_back('\0');  // owners are hex: the key is unambiguous
    key += name;
    return key;
}

std::string le64(int64_t v) {
    std::string out(8, '\0');
    for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
    return out;
}

// The scheduler's interference terms (victim kind, aggressor kind, slowdown per aggressor) of
// the DRAM the cores share, as the daemon gives its Python scheduler.
std::vector<std::tuple<std::string, std::string, double>> interference(const Config& c) {
    static const char* kinds[] = {"dla", "gpu"};
    std::vector<std::tuple<std::string, std::string, double>> out;
    if (!c.dram) return out;
    for (size_t v = 0; v < 2; ++v) {
        for (size_t a = 0; a < 2; ++a) {
            const double k = c.dram->k()[v][a] * c.dram->contention();
            if (k != 0) out.emplace_back(kinds[v], kinds[a], k);
        }
    }
    return out;
}

template <typename F>
F symbol(void* lib, const char* name) {
    void* p = dlsym(lib, name);
    if (p == nullptr) throw std::runtime_error(std::string("libzmq has no ") + name);
    return reinterpret_cast<F>(p);
}

}  // namespace

ZmqApi ZmqApi::load(const std::string& path) {
    // RTLD_NOLOAD: the library pyzmq loaded, never a second copy (two copies of libzmq in one
    // process would not share their sockets).
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) throw std::runtime_error("libzmq is not loaded from " + path);
    ZmqApi api{};
    api.msg_init = symbol<decltype(api.msg_init)>(lib, "zmq_msg_init");
    api.msg_init_size = symbol<decltype(api.msg_init_size)>(lib, "zmq_msg_init_size");
    api.msg_recv = symbol<decltype(api.msg_recv)>(lib, "zmq_msg_recv");
    api.msg_send = symbol<decltype(api.msg_send)>(lib, "zmq_msg_send");
    api.msg_close = symbol<decltype(api.msg_close)>(lib, "zmq_msg_close");
    api.msg_move = symbol<decltype(api.msg_move)>(lib, "zmq_msg_move");
    api.msg_data = symbol<decltype(api.msg_data)>(lib, "zmq_msg_data");
    api.msg_size = symbol<decltype(api.msg_size)>(lib, "zmq_msg_size");
    api.msg_more = symbol<decltype(api.msg_more)>(lib, "zmq_msg_more");
    api.send = symbol<decltype(api.send)>(lib, "zmq_send");
    api.poll = symbol<decltype(api.poll)>(lib, "zmq_poll");
    api.errno_ = symbol<decltype(api.errno_)>(lib, "zmq_errno");
    api.msg_gets = symbol<decltype(api.msg_gets)>(lib, "zmq_msg_gets");
    api.msg_get = symbol<decltype(api.msg_get)>(lib, "zmq_msg_get");
    dlclose(lib);  // the reference NOLOAD took: pyzmq's own keeps the library loaded
    return api;
}

Part::Part(Part&& o) noexcept : api_(o.api_) {
    api_->msg_init(&msg_);
    api_->msg_move(&msg_, &o.msg_);  // o is left an empty message
}

// ------------------------------------------------------------------------------ the plane

Plane::Plane(ZmqApi api, void* router, void* forward, Config config)
    : api_(api),
      router_(router),
      forward_(forward),
      config_(std::move(config)),
      scheduler_(config_.alpha, config_.policy, interference(config_), config_.pins) {
    dram_ = config_.dram;
    std::map<std::string, std::vector<std::string>> served;  // device -> its models
    for (const auto& [model, devices] : config_.models) {
        if (config_.settings.count(model) == 0) {
            throw std::invalid_argument("model " + model + ": no detection settings");
        }
        for (const auto& d : devices) served[d].push_back(model);
    }
    for (const auto& d : config_.devices) {
        if (!(d.latency_us > 0) || d.slots < 1 || d.capacity < 1 || d.max_batch < 1) {
            throw std::invalid_argument("device " + d.name +
                                        ": latency_us, slots, capacity and max_batch must be "
                                        "positive");
        }
        if (d.kind != "dla" && d.kind != "gpu" && !d.kind.empty()) {
            throw std::invalid_argument("device " + d.name + ": its kind is dla, gpu or \"\"");
        }
        if (engines_.count(d.name) != 0) throw std::invalid_argument("device " + d.name + " twice");
        auto on_done = [this, name = d.name](Finished f) {
            {
                std::lock_guard<std::mutex> lock(mu_);
                done_.emplace_back(name, std::move(f));
            }
            wake();
        };
        std::unique_ptr<Engine> engine;
        if (d.make) {
            engine = d.make(on_done);
        } else if (d.gpu && !d.graphs.empty()) {
            engine = std::make_unique<GpuBatchEngine>(d.name, config_.cuda, *d.gpu, d.graphs,
                                                      d.slots, on_done);
        } else if (d.gpu) {
            engine = std::make_unique<ChainEngine>(d.name, config_.cuda, *d.gpu, d.latency_us,
                                                   dram_.get(), config_.cudla, d.cudla, on_done);
        } else if (d.cudla) {
            // real silicon shares real DRAM: the emulated model is not applied to it
            engine = std::make_unique<CudlaEngine>(d.name, config_.cudla, *d.cudla, on_done);
        } else if (d.kind == "gpu") {  // the emulated Orin GPU in timing mode
            std::vector<double> curve;
            for (int64_t n = 1; n <= d.max_batch; ++n) {
                const auto known = d.curve_us.find(n);
                if (n > 1 && known == d.curve_us.end()) {
                    throw std::invalid_argument("device " + d.name + ": its batch curve has no "
                                                "batch of " + std::to_string(n));
                }
                curve.push_back(n == 1 && known == d.curve_us.end() ? d.latency_us
                                                                     : known->second);
            }
            engine = std::make_unique<TimingEngine>(d.name, std::move(curve), d.slots, on_done,
                                                    dram_.get());
        } else {
            engine = std::make_unique<TimingEngine>(d.name, d.latency_us, d.slots, on_done,
                                                    dram_.get());
        }
        if (engine == nullptr || engine->slots() != d.slots ||
            engine->max_batch() != d.max_batch) {
            throw std::invalid_argument("device " + d.name +
                                        ": its engine's slots or batch differ from its spec");
        }
        auto& models = served[d.name];
        std::sort(models.begin(), models.end());
        if (!models.empty()) first_model_[d.name] = models.front();
        watches_[d.name] = Watch{};
        std::map<int64_t, double> known{{1, d.latency_us * 1e3}};
        for (const auto& [size, us] : d.curve_us) known[size] = us * 1e3;
        scheduler_.add_device(d.name, models, d.capacity, d.max_batch, known, d.tier, d.kind);
        resource_[d.name] = d.make ? "interpreter" : "plane";  // a Python engine's: the GIL
        scheduler_.set_resource(d.name, resource_[d.name]);
        if (d.make) resource_busy_ns_["interpreter"] = 0;
        engines_[d.name] = std::move(engine);
        batch_delay_us_[d.name] = d.max_queue_delay_us;
        running_[d.name] = 0;
    }
    for (const auto& [device, models] : served) {
        if (engines_.count(device) == 0) {
            throw std::invalid_argument("model " + models.front() + ": no device " + device);
        }
    }
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
}

Plane::~Plane() {
    close();
    if (event_fd_ >= 0) ::close(event_fd_);
}

void Plane::close() {
    drain(0);
    std::lock_guard<std::mutex> lock(join_mu_);
    // Each engine stops as it says (engine.hpp): no report arrives after this, and nothing
    // of theirs runs on the GPU
    engines_.clear();
}

void Plane::start() {
    if (thread_.joinable()) return;
    {
        std::lock_guard<std::mutex> lock(mu_);
        running_thread_ = true;
    }
    thread_ = std::thread([this] {
        pthread_setname_np(pthread_self(), "dlad-plane");
        run();
    });
}

void Plane::drain(double timeout_ms) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!draining_) {
            draining_ = true;
            drain_until_ns_ = now_ns() + static_cast<int64_t>(std::max(timeout_ms, 0.0) * 1e6);
        }
    }
    wake();
    std::lock_guard<std::mutex> lock(join_mu_);  // callers on two threads: one joins
    if (thread_.joinable()) thread_.join();
}

namespace {

// The socket on ``fd`` as the kernel names it for its lifetime (0: none): an fd is reused by
// the next connection as soon as one closes, a cookie never.
uint64_t socket_cookie(int fd) {
    uint64_t cookie = 0;
    socklen_t size = sizeof cookie;
    return getsockopt(fd, SOL_SOCKET, SO_COOKIE, &cookie, &size) == 0 ? cookie : 0;
}

struct Connection {
    int fd = -1;  // -1: none
    uint32_t generation = 0;
    uint64_t cookie = 0;
};

// A connection's 16 bytes (Plane::connection_of): (fd, generation, cookie).
Connection parse_connection(const std::string& conn) {
    Connection c;
    if (conn.size() != 16) return c;
    int32_t fd = 0;
    std::memcpy(&fd, conn.data(), 4);
    std::memcpy(&c.generation, conn.data() + 4, 4);
    std::memcpy(&c.cookie, conn.data() + 8, 8);
    c.fd = fd;
    return c;
}

}  // namespace

std::string Plane::connection_of(int fd) const {
    std::string out(16, '\0');
    const int32_t f = fd;
    const bool known = fd >= 0 && fd < kMaxFds;
    const uint32_t generation = known ? generation_[fd].load(std::memory_order_acquire) : 0;
    const uint64_t cookie = known ? socket_cookie(fd) : 0;
    std::memcpy(out.data(), &f, 4);
    std::memcpy(out.data() + 4, &generation, 4);
    std::memcpy(out.data() + 8, &cookie, 8);
    return out;
}

void Plane::send(std::string client, std::vector<std::string> frames, const std::string& conn) {
    const Connection c = parse_connection(conn);
    if (c.fd >= 0 && c.fd < kMaxFds &&
        generation_[c.fd].load(std::memory_order_acquire) != c.generation &&
        !newer_connection(c.fd, c.cookie)) {
        std::lock_guard<std::mutex> lock(mu_);  // its connection closed: not for a newcomer
        ++counters_.orphaned;
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (running_thread_) {
            outbox_.emplace_back(std::move(client), std::move(frames));
            wake();
            return;
        }
    }
    // the thread has ended (its last act was to send what was queued): the socket is free
    std::lock_guard<std::mutex> lock(inline_mu_);
    outbox_.emplace_back(std::move(client), std::move(frames));
    send_outbox();
}

Counters Plane::counters() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counters_;
}

void Plane::call(const std::function<void()>& fn) {
    {
        std::unique_lock<std::mutex> lock(mu_);
        if (running_thread_) {
            Call c{&fn};
            calls_.push_back(&c);
            wake();
            called_.wait(lock, [&c] { return c.done; });
            return;
        }
    }
    std::lock_guard<std::mutex> lock(inline_mu_);
    fn();
}

void Plane::run_calls() {
    std::vector<Call*> calls;
    {
        std::lock_guard<std::mutex> lock(mu_);
        calls.swap(calls_);
    }
    if (calls.empty()) return;
    for (Call* c : calls) (*c->fn)();
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (Call* c : calls) c->done = true;
    }
    called_.notify_all();
}

void Plane::connection_opened(int fd) {
    // The generation moves at closes only: the monitor tells of an accept after the new
    // connection's first messages may have been read (and their replies then taken for a
    // closed connection's).
    if (fd < 0 || fd >= kMaxFds) return;
    spoke_[fd].store(0, std::memory_order_relaxed);
    opened_cookie_[fd].store(socket_cookie(fd), std::memory_order_release);
}

bool Plane::newer_connection(int fd, uint64_t cookie) const {
    // a reply whose fd's generation has moved since its message was read: still its
    // connection's if that connection came after the one the last close was of, and holds the
    // fd now
    return cookie != 0 && cookie != closed_cookie_[fd].load(std::memory_order_acquire) &&
           socket_cookie(fd) == cookie;
}

int64_t Plane::connection_closed(int fd) {
    if (fd < 0 || fd >= kMaxFds) return 0;
    // From here the closed connection's replies are dropped (answer() compares generations),
    // whichever thread answers them.
    // the closed connection's socket (0: unknown, and all the generation's work is its)
    const uint64_t closed = opened_cookie_[fd].exchange(0, std::memory_order_acq_rel);
    closed_cookie_[fd].store(closed, std::memory_order_release);
    const uint32_t ended = generation_[fd].fetch_add(1, std::memory_order_acq_rel);
    const uint64_t now_on_fd = closed != 0 ? socket_cookie(fd) : 0;
    int64_t cancelled = 0;
    call([&] {
        std::vector<int64_t> found;
        for (auto& [id, job] : jobs_) {
            if (job.fd != fd || job.generation != ended || job.probe) continue;
            // kept: work of a socket that is not the closed one and holds the fd now
            if (closed != 0 && job.cookie != 0 && job.cookie != closed && job.cookie == now_on_fd) {
                job.generation = ended + 1;  // a newer connection's, read before this close
                continue;
            }
            found.push_back(id);
        }
        std::sort(found.begin(), found.end());
        for (int64_t id : found) {
            if (!scheduler_.cancel(id)) continue;  // running: its reply is dropped when done
            answer(id, CANCELLED, "its connection closed");
            ++cancelled;
        }
    });
    std::lock_guard<std::mutex> lock(mu_);
    counters_.cancelled_on_close += cancelled;
    return cancelled;
}

CancelResult Plane::cancel(const std::string& client, uint64_t request_id) {
    CancelResult out = CancelResult::not_queued;
    call([&] {
        std::vector<int64_t> found;
        for (const auto& [id, job] : jobs_) {
            if (job.client == client && job.request_id == request_id) found.push_back(id);
        }
        if (found.empty()) return;
        out = CancelResult::running;
        std::sort(found.begin(), found.end());
        for (int64_t id : found) {
            if (!scheduler_.cancel(id)) continue;  // running: it gets its normal result
            answer(id, CANCELLED, "cancelled by the client");
            out = CancelResult::cancelled;
        }
    });
    return out;
}

std::optional<std::pair<int64_t, std::string>> Plane::submit(const std::string& client,
                                                             const std::string& owner,
                                                             uint64_t request_id,
                                                             std::optional<int64_t> tag,
                                                             std::vector<Item> items,
                                                             const std::string& conn) {
    std::optional<std::pair<int64_t, std::string>> out;
    const Connection c = parse_connection(conn);
    const int fd = c.fd;
    call([&] {
        const int64_t now = now_ns();
        uint64_t size = 0;
        for (const Item& item : items) size += item.size;
        const std::string key = key_of(client, request_id);
        out = room(key, request_id, owner, static_cast<int64_t>(items.size()), size);
        if (out) return;
        for (size_t i = 0; i < items.size(); ++i) {
            Job job;
            job.client = client;
            job.request_id = request_id;
            job.tag = tag;
            job.index = static_cast<int64_t>(i);
            if (fd >= 0 && fd < kMaxFds) {  // cancelled when its connection closes
                job.fd = fd;
                job.generation = c.generation;
                job.cookie = c.cookie;
            }
            job.owner = owner;
            job.model = items[i].model;
            job.received_ns = now;
            job.size = items[i].size;
            job.image = items[i].image;
            job.pixels = std::move(items[i].pixels);  // the items are this call's
            if (items[i].shm) {
                std::string seg = segment_key(owner, *items[i].shm);
                if (segments_.count(seg) != 0) job.segment = std::move(seg);
                job.shm_offset = items[i].shm_offset;
            }
            // each to an idle core at once, as the plane's INFERs are: the queues then hold
            // what the cores cannot start
            if (admit(std::move(job), key, items[i], now, nullptr)) dispatch(now);
        }
    });
    return out;
}

State Plane::state() {
    State out;
    call([&] {
        out.devices = scheduler_.snapshot();
        out.busy_ns = busy_ns_;
        out.failed = failed_;
        out.failing = failing_;
        out.last_failure = last_failure_;
        for (const auto& [device, w] : watches_) {
            if (w.quarantined) out.quarantined[device] = w.reason;
            out.quarantines[device] = w.quarantines;
        }
        out.queued = scheduler_.queued();
        out.streams_waiting = scheduler_.streams_waiting();
    });
    return out;
}

bool Plane::add_segment(const std::string& owner, const std::string& name, uint64_t size,
                        const std::string& token, const uint8_t* host, uint64_t device) {
    bool ok = true;
    call([&] {
        Segment& seg = segments_[segment_key(owner, name)];
        if (seg.size != size && seg.users > 0) {
            ok = false;
            return;
        }
        seg.size = size;
        seg.token = token;
        seg.last_used_ns = now_ns();
        if (seg.users == 0) {  // else the same mapping, named again
            seg.host = host;
            seg.device = device;
        }
    });
    return ok;
}

bool Plane::drop_segment(const std::string& owner, const std::string& name) {
    bool ok = true;
    call([&] {
        const auto it = segments_.find(segment_key(owner, name));
        if (it == segments_.end()) return;
        if (it->second.users > 0) {
            ok = false;
            return;
        }
        segments_.erase(it);
    });
    return ok;
}

std::vector<std::pair<std::string, std::string>> Plane::idle_segments(double idle_ms) {
    std::vector<std::pair<std::string, std::string>> out;
    call([&] {
        const int64_t before = now_ns() - static_cast<int64_t>(idle_ms * 1e6);
        for (auto it = segments_.begin(); it != segments_.end();) {
            if (it->second.users == 0 && it->second.last_used_ns <= before) {
                const size_t cut = it->first.find('\0');
                out.emplace_back(it->first.substr(0, cut), it->first.substr(cut + 1));
                it = segments_.erase(it);
            } else {
                ++it;
            }
        }
    });
    return out;
}

std::vector<Observation> Plane::take_observations() {
    std::vector<Observation> out;
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(observations_);
    return out;
}

void Plane::wake() {
    const uint64_t one = 1;
    // A full counter (2^64 - 2 wake-ups unread) still wakes the poll: nothing is lost.
    [[maybe_unused]] const ssize_t n = write(event_fd_, &one, sizeof one);
}

void Plane::run() {
    ZmqPollItem items[3] = {{router_, 0, kPollIn, 0},
                            {nullptr, event_fd_, kPollIn, 0},
                            {forward_, 0, kPollOut, 0}};
    while (true) {
        // the socket is always read (docs/reliability.md, "A flood that vanishes"); with a
        // backlog for the control plane, its room is waited for too
        int64_t now = now_ns();
        bool draining = false;
        int64_t until = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            draining = draining_;
            until = drain_until_ns_;
        }
        if (draining && !shed_) {
            // the daemon's drain: what is queued is answered at once, what runs finishes
            shed_ = true;
            for (int64_t id : scheduler_.drain()) {
                answer(id, SHUTTING_DOWN, "the daemon is shutting down");
            }
        }
        if (draining && (jobs_.empty() || now >= until)) break;
        if (api_.poll(items, backlog_.empty() ? 2 : 3, poll_timeout(now)) < 0 &&
            api_.errno_() != EINTR) {
            break;
        }
        if (items[1].revents & kPollIn) {
            uint64_t n = 0;
            [[maybe_unused]] const ssize_t r = read(event_fd_, &n, sizeof n);
        }
        now = now_ns();
        take_completions();
        run_calls();
        send_outbox();
        read_messages();
        for (int64_t id : scheduler_.expire(now_ns())) {
            answer(id, DEADLINE_EXCEEDED, "deadline passed while queued");
        }
        if (!draining) start_probes(now_ns());
        dispatch(now_ns());
    }
    // Draining's end: what the socket holds is read (INFERs are answered SHUTTING_DOWN, the
    // rest forwarded), then what is left is answered SHUTTING_DOWN (queued, then running).
    while (read_messages() == kBurst) {
    }
    for (int64_t id : scheduler_.drain()) {
        answer(id, SHUTTING_DOWN, "the daemon is shutting down");
    }
    std::vector<int64_t> left;
    for (const auto& [id, job] : jobs_) left.push_back(id);
    std::sort(left.begin(), left.end());
    for (int64_t id : left) answer(id, SHUTTING_DOWN, "the daemon is shutting down");
    flush_backlog(/*block=*/true);  // the control plane reads until this thread has ended
    // From here calls and sends run on their callers' threads; those queued before are run
    // and sent here first, in their order, before any caller's own.
    std::lock_guard<std::mutex> inline_lock(inline_mu_);
    {
        std::lock_guard<std::mutex> lock(mu_);
        running_thread_ = false;
    }
    run_calls();
    send_outbox();
}

long Plane::poll_timeout(int64_t now) const {
    std::optional<int64_t> at = scheduler_.earliest_deadline();
    if (batch_wake_ns_ && (!at || *batch_wake_ns_ < *at)) at = batch_wake_ns_;
    for (const auto& [device, w] : watches_) {  // a quarantined engine's probe is due
        if (w.quarantined && w.probe < 0 && (!at || w.probe_at_ns < *at)) at = w.probe_at_ns;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (draining_ && (!at || drain_until_ns_ < *at)) at = drain_until_ns_;
    }
    if (!at) return -1;
    const int64_t wait = *at - now;
    return wait <= 0 ? 0 : static_cast<long>((wait + 999'999) / 1'000'000);  // ceil, in ms
}

int Plane::read_messages() {
    flush_backlog(/*block=*/false);
    int n = 0;
    for (; n < kBurst; ++n) {
        std::vector<Part> parts;
        parts.reserve(4);
        parts.emplace_back(&api_);
        if (api_.msg_recv(parts.back().get(), router_, kDontWait) < 0) break;  // none waits
        // the connection it came from has spoken (ZMQ_SRCFD: the file descriptor it was read
        // from), so it counts toward the connection cap
        const int fd = api_.msg_get(parts.back().get(), kSrcFd);
        reading_ = nullptr;
        if (fd >= 0 && fd < kMaxFds) {
            spoke_[fd].store(1, std::memory_order_relaxed);
            saw(fd, parts.back());
        }
        while (api_.msg_more(parts.back().get())) {
            parts.emplace_back(&api_);
            if (api_.msg_recv(parts.back().get(), router_, kDontWait) < 0) {
                parts.pop_back();  // cannot happen: a message's parts arrive together
                break;
            }
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            ++counters_.received;
        }
        handle(parts);
    }
    return n;
}

void Plane::handle(std::vector<Part>& parts) {
    // [routing id, header, payload...]: an INFER is served here; a STATUS, a CANCEL and a
    // message the decoder refuses are counted against their client's rate of cheap messages
    // first (past it, answered OVERLOADED here: a flood never reaches the control plane, which
    // serves everyone's slow messages); the rest is the control plane's, which decodes it
    // again with the same decoder (and answers a refusal in its words, and logs it)
    if (reading_ != nullptr && reading_->cut) {  // a connection cut for flooding: gone
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.dropped_over_rate;
        return;
    }
    if (parts.size() >= 2) {
        uint64_t payload = parts.size() == 3 ? parts[2].size() : 0;
        std::vector<uint64_t> payloads;  // four parts or more: refused, but by the decoder
        for (size_t i = 2; parts.size() > 3 && i < parts.size(); ++i) {
            payloads.push_back(parts[i].size());
        }
        wire::Decoded d = wire::decode_request(
            parts[1].data(), parts[1].size(), payloads.empty() ? &payload : payloads.data(),
            parts.size() - 2, config_.limits, config_.shm);
        if (d.request) {
            if (d.request->kind == wire::kInfer) {
                infer(parts, *d.request);
                return;
            }
            const auto cheap = wire::as_cheap(*d.request);
            const Rate rate = cheap ? over_rate(parts) : Rate::kWithin;
            if (rate == Rate::kRefuse) {
                const std::string words = rate_words("STATUS and CANCEL requests");
                send_reply(client_of(parts), wire::write_cheap_reply(*cheap, OVERLOADED, words),
                           nullptr, 0, OVERLOADED, /*payload_frame=*/false);
            }
            if (rate != Rate::kWithin) return;
            forward(parts, {"", "", d.request->id, d.request->kind});
            return;
        }
        const Rate rate = over_rate(parts);
        if (rate == Rate::kRefuse) refuse_over_rate(parts, d.refusal);
        if (rate == Rate::kWithin) forward(parts, d.refusal);
        return;
    }
    const Rate rate = over_rate(parts);  // a routing id and nothing else
    if (rate == Rate::kRefuse) refuse_over_rate(parts, {});
    if (rate == Rate::kWithin) forward(parts, {});
}

void Plane::refuse_over_rate(std::vector<Part>& parts, const wire::Refusal& refusal) {
    refuse_unread(client_of(parts), refusal,
                  rate_words("malformed, STATUS and CANCEL requests"), &Counters::refused_over_rate);
}

void Plane::refuse_unread(const std::string& client, const wire::Refusal& refusal,
                          const std::string& words, int64_t Counters::*counter) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        ++(counters_.*counter);
        if (observations_.size() < kMaxObservations) {  // a reply of no model, no device
            observations_.push_back({"", "", OVERLOADED, 0, 0, 0});
        } else {
            ++counters_.observations_lost;
        }
    }
    bool payload_frame = false;
    const std::string header =
        wire::write_refusal_reply(refusal, OVERLOADED, words, &payload_frame);
    send_reply(client, header, nullptr, 0, OVERLOADED, payload_frame);
}

std::string Plane::rate_words(const char* what) const {
    char words[128];
    std::snprintf(words, sizeof words, "more than %g %s a second", config_.cheap_requests_per_s,
                  what);
    return words;
}

std::string Plane::client_of(std::vector<Part>& parts) {
    return std::string(reinterpret_cast<const char*>(parts[0].data()), parts[0].size());
}

Plane::Rate Plane::over_rate(std::vector<Part>& parts) {
    constexpr size_t kMaxClientsTracked = 10'000;  // more: every bucket is forgotten (refilled)
    // A bucket of 2 x rate tokens, refilled at rate: a message takes one, or is refused taking
    // one of as many again below zero (64 at least); below that it is dropped unanswered, so
    // that a flood costs the plane a lookup a message and no reply (which a flooder does not
    // read anyway).
    const double rate = config_.cheap_requests_per_s;
    const double refusals = std::max(2 * rate, static_cast<double>(kMinRefusals));
    std::string owner = config_.curve ? property(parts, "User-Id") : "";
    if (owner.empty()) owner = hex(client_of(parts));
    const int64_t now = now_ns();
    auto it = buckets_.find(owner);
    double tokens = 2 * rate;
    if (it != buckets_.end()) {
        const double refill = static_cast<double>(now - it->second.second) / 1e9 * rate;
        tokens = std::min(2 * rate, it->second.first + refill);
    }
    if (it == buckets_.end() && buckets_.size() >= kMaxClientsTracked) buckets_.clear();
    const Rate verdict = tokens >= 1            ? Rate::kWithin
                         : tokens >= 1 - refusals ? Rate::kRefuse
                                                  : Rate::kDrop;
    buckets_[owner] = {verdict == Rate::kDrop ? tokens : tokens - 1, now};
    if (verdict == Rate::kDrop) dropped_from();
    return verdict;
}

namespace {

// Whether two segment tokens are equal, in a time that does not tell where they differ.
bool same_token(const std::string& a, const std::string& b) {
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

uint64_t fnv1a(const uint8_t* data, size_t size) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ULL;
    return h | 1;  // never 0, the hash of no connection
}

}  // namespace

void Plane::saw(int fd, Part& id) {
    constexpr size_t kMaxPeers = 1 << 16;  // more: those whose socket is gone are forgotten
    const uint64_t h = fnv1a(id.data(), id.size());
    const uint32_t generation = generation_[fd].load(std::memory_order_acquire);
    auto it = peers_.find(h);
    if (it != peers_.end() && it->second.fd == fd) {
        Peer& p = it->second;
        reading_ = &p;
        // the fd's generation moved (the control plane heard of an accept or a close on it):
        // still this connection while the fd holds the same socket; else a closed
        // connection's last messages (libzmq takes no new connection on a routing id whose
        // messages are still unread), never cut again; those of a cut one are still dropped
        // unparsed, for a second: then a new connection may have taken the routing id
        if (p.generation != generation && p.cookie != 0 && socket_cookie(fd) != p.cookie) {
            p.cookie = 0;
            p.stale_ns = now_ns();
        }
        if (p.cut && p.cookie == 0 && now_ns() - p.stale_ns > 1'000'000'000) p.cut = false;
        p.generation = generation;
        return;
    }
    if (it == peers_.end() && peers_.size() >= kMaxPeers) {
        for (auto at = peers_.begin(); at != peers_.end();) {
            at = socket_cookie(at->second.fd) == at->second.cookie ? std::next(at)
                                                                   : peers_.erase(at);
        }
        if (peers_.size() >= kMaxPeers) peers_.clear();
    }
    Peer& p = peers_[h];  // new, or its routing id on another fd
    p = {fd, generation, socket_cookie(fd), 0, false, 0};
    reading_ = &p;
}

void Plane::dropped_from() {
    int64_t cut = 0;
    if (reading_ != nullptr && reading_->cookie != 0) {
        Peer& p = *reading_;
        const auto cut_after = static_cast<uint32_t>(
            std::min(std::max(2 * config_.cheap_requests_per_s, double{kMinRefusals}), 1e9));
        if (++p.dropped == cut_after && socket_cookie(p.fd) == p.cookie) {
            // the engine reads its end of file and closes the connection as any peer's; what
            // it had read is still read here, and dropped unparsed (handle)
            p.cut = shutdown(p.fd, SHUT_RDWR) == 0;
            cut = p.cut ? 1 : 0;
        }
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.dropped_over_rate;
    counters_.cut += cut;
}

void Plane::forward(std::vector<Part>& parts, const wire::Refusal& address) {
    Pending m{std::move(parts), {}};
    if (backlog_.empty() && send_forward(m, kDontWait)) {
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.forwarded;
        return;
    }
    // The control plane is _FORWARD_HWM messages behind: the message is answered OVERLOADED
    // here, in the reply its header can address, and the socket is still read (a connection
    // whose messages queue in libzmq unread can abort it: docs/reliability.md).
    refuse_unread(client_of(m.parts), address, "the daemon's control plane is behind; try again",
                  &Counters::refused_busy);
}

bool Plane::send_forward(Pending& m, int flags) {
    bool ok = true;
    if (!m.parts.empty()) {
        // [routing id, the peer's address, its CURVE key, its connection, the message's
        // parts...]: a message's metadata does not cross the pair, and the control plane needs
        // the peer (shared memory is for this host's), the key (who the client is) and the
        // connection (its replies are for that connection only)
        std::vector<Part>& parts = m.parts;
        const std::string address = property(parts, "Peer-Address");
        const std::string user = property(parts, "User-Id");
        const std::string conn = connection_of(api_.msg_get(parts[0].get(), kSrcFd));
        // a message's first part is taken whole or not at all (the rest then always is)
        if (api_.msg_send(parts[0].get(), forward_, flags | kSndMore) < 0) return false;
        const int more = parts.size() > 1 ? kSndMore : 0;
        ok = api_.send(forward_, address.data(), address.size(), flags | kSndMore) >= 0 &&
             api_.send(forward_, user.data(), user.size(), flags | kSndMore) >= 0 &&
             api_.send(forward_, conn.data(), conn.size(), flags | more) >= 0;
        for (size_t i = 1; ok && i < parts.size(); ++i) {
            ok = api_.msg_send(parts[i].get(), forward_,
                               flags | (i + 1 < parts.size() ? kSndMore : 0)) >= 0;
        }
    } else {
        const auto& frames = m.frames;
        if (api_.send(forward_, frames[0].data(), frames[0].size(), flags | kSndMore) < 0) {
            return false;
        }
        for (size_t i = 1; ok && i < frames.size(); ++i) {
            ok = api_.send(forward_, frames[i].data(), frames[i].size(),
                           flags | (i + 1 < frames.size() ? kSndMore : 0)) >= 0;
        }
    }
    if (!ok) {  // cannot happen once its first part was taken
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.forward_lost;
    }
    return true;
}

void Plane::flush_backlog(bool block) {
    while (!backlog_.empty()) {
        if (!send_forward(backlog_.front(), block ? 0 : kDontWait)) break;
        backlog_.pop_front();
    }
    if (block && !backlog_.empty()) {  // its reader is gone (the send timed out)
        std::lock_guard<std::mutex> lock(mu_);
        counters_.forward_lost += static_cast<int64_t>(backlog_.size());
        backlog_.clear();
    }
}

std::string Plane::property(std::vector<Part>& parts, const char* name) {
    // the first part after the routing id carries the connection's metadata
    const char* value = parts.size() > 1 ? api_.msg_gets(parts[1].get(), name) : nullptr;
    return value == nullptr ? "" : value;
}

void Plane::infer(std::vector<Part>& parts, const wire::Request& req) {
    const wire::Image& img = req.images.front();  // an INFER has one
    const int64_t now = now_ns();
    Job job;
    job.client.assign(reinterpret_cast<const char*>(parts[0].data()), parts[0].size());
    job.request_id = req.id;
    // the connection it came on, and that connection's generation now
    const int fd = api_.msg_get(parts[0].get(), kSrcFd);
    if (fd >= 0 && fd < kMaxFds) {
        job.fd = fd;
        job.generation = generation_[fd].load(std::memory_order_acquire);
        job.cookie = socket_cookie(fd);
    }
    // who the client is (Frontend._identity): its CURVE key, else its connection
    job.owner = config_.curve ? property(parts, "User-Id") : "";
    if (job.owner.empty()) job.owner = hex(job.client);
    job.model = req.model;
    job.received_ns = now;
    job.size = img.bytes();
    job.image = {img.height, img.width, img.format, img.colour, req.conf, req.iou, req.max_det};
    if (img.shm) {
        // a frame in a segment the control plane registered (the decoder checked that it
        // lies inside the segment the client names): else the control plane maps the
        // segment, checks it and the peer, or refuses naming why
        std::string seg = segment_key(job.owner, img.shm->name);
        const auto it = segments_.find(seg);
        if (it == segments_.end() || it->second.size != img.shm->size ||
            !same_token(it->second.token, img.shm->token) ||
            shm_guard::broken(reinterpret_cast<uintptr_t>(it->second.host))) {
            // (a segment that shrank: the control plane refuses and drops it)
            forward(parts, {"", "", req.id, wire::kInfer});
            return;
        }
        job.segment = std::move(seg);
        job.shm_offset = img.shm->offset;
        job.size = 0;  // the client's memory, not the daemon's budget
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.shm_frames;
    }
    const std::string key = key_of(job.client, req.id);
    bool own = false;
    if (auto why = room(key, req.id, job.owner, 1, job.size, &own)) {
        // a refusal of the client's own making (its cap, an id in flight) costs it a token of
        // its cheap messages: a flood of them is dropped past its refusals, as junk is
        if (!own || over_rate(parts) != Rate::kDrop) refuse(job, why->first, why->second);
        return;
    }
    const Item item{req.model, img.stream, req.priority, req.deadline_ms, job.size, std::nullopt,
                    0,          {},         {}};
    std::shared_ptr<Part> payload;
    if (parts.size() == 3) payload = std::make_shared<Part>(std::move(parts[2]));
    if (admit(std::move(job), key, item, now, std::move(payload))) {
        dispatch(now);  // an idle core takes it now, not after the rest of the burst
    }
}

std::optional<std::pair<int64_t, std::string>> Plane::room(const std::string& key,
                                                           uint64_t request_id,
                                                           const std::string& owner,
                                                           int64_t frames, uint64_t size,
                                                           bool* own) {
    // The frontend's room check (Frontend._room), in its order and words
    if (own != nullptr) *own = true;  // unless the daemon's state refuses it (below)
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (draining_) {
            if (own != nullptr) *own = false;
            return std::make_pair(SHUTTING_DOWN, "the daemon is shutting down");
        }
    }
    if (in_use_.count(key) != 0) {
        return std::make_pair(BAD_REQUEST, "request id " + std::to_string(request_id) +
                                               " is already in flight on this connection");
    }
    const int64_t cap = config_.max_in_flight_per_client;
    const auto held_at = in_flight_.find(owner);
    const int64_t held = held_at == in_flight_.end() ? 0 : held_at->second;
    if (held + frames > cap) {
        const std::string more = frames == 1 ? ""
                                              : "; these " + std::to_string(frames) +
                                                    " images would pass it (" +
                                                    std::to_string(held) + " held)";
        return std::make_pair(
            OVERLOADED, held >= cap ? "this client has " + std::to_string(cap) +
                                          " requests in flight, the most one may" + more
                                    : "a client may have " + std::to_string(cap) +
                                          " requests in flight" + more);
    }
    if (size && buffered_ + size > config_.max_buffered_bytes) {
        if (own != nullptr) *own = false;
        return std::make_pair(OVERLOADED,
                              "the daemon holds " + std::to_string(buffered_) +
                                  " bytes of frames; this one would pass its budget of " +
                                  std::to_string(config_.max_buffered_bytes));
    }
    return std::nullopt;
}

bool Plane::admit(Job job, const std::string& key, const Item& item, int64_t now,
                  std::shared_ptr<Part> payload) {
    // admission: the deadline, then the scheduler's verdict
    const double budget_ms = std::min(
        item.deadline_ms ? static_cast<double>(*item.deadline_ms) : config_.default_deadline_ms,
        config_.max_deadline_ms);
    JobSpec spec{next_job_++, item.model, now + static_cast<int64_t>(budget_ms * 1e6),
                 item.priority, item.stream, job.owner};
    AdmitResult r = scheduler_.admit(spec, {}, now);
    std::optional<int64_t> victim;
    if (r.refusal == Refusal::overloaded) {
        // full queues are shared fairly: the client holding the most gives up its newest frame
        victim = scheduler_.displace_for(spec);
        if (victim) r = scheduler_.admit(spec, {}, now);
    }
    if (r.refusal != Refusal::none) {
        const auto [status, why] = refusal(r, item.model, spec.id);
        refuse(job, status, why);
        return false;
    }
    job.payload = std::move(payload);
    job.device = r.placed.device;
    job.spec = spec;
    if (!job.segment.empty()) {
        Segment& seg = segments_.at(job.segment);
        ++seg.users;
        seg.last_used_ns = now;
    }
    ++in_use_[key];
    ++in_flight_[job.owner];
    buffered_ += job.size;
    buffered_bytes_.store(buffered_);
    jobs_.emplace(spec.id, std::move(job));
    pending_.store(static_cast<int64_t>(jobs_.size()));
    if (victim) {
        answer(*victim, OVERLOADED,
               "displaced by another client's frame: this client held the most of the full "
               "queues");
    }
    for (int64_t old : r.superseded) {
        answer(old, CANCELLED, "superseded by a newer frame of its stream");
    }
    return true;
}

std::pair<int64_t, std::string> Plane::refusal(const AdmitResult& r, const std::string& model,
                                               int64_t id) {
    if (r.refusal == Refusal::not_found) {
        return {NOT_FOUND, "no device serves model " + wire::py_repr(model)};
    }
    if (r.refusal == Refusal::overloaded) {
        std::string why = "all queues for model " + wire::py_repr(model) + " are full (";
        for (size_t i = 0; i < r.full.size(); ++i) {
            why += (i ? ", " : "") + r.full[i].name + " " + std::to_string(r.full[i].depth) + "/" +
                   std::to_string(r.full[i].capacity);
        }
        return {OVERLOADED, why + ")"};
    }
    if (r.refusal == Refusal::device_failed) {
        std::string why = "no healthy device serves model " + wire::py_repr(model) + " now (";
        for (size_t i = 0; i < r.unhealthy.size(); ++i) {
            why += (i ? ", " : "") + r.unhealthy[i].first +
                   (r.unhealthy[i].second ? " failed it" : " quarantined");
        }
        return {DEVICE_FAILED, why + ")"};
    }
    return {INTERNAL, "request id " + std::to_string(id) + " is already queued"};
}

void Plane::refuse(const Job& job, int64_t status, const std::string& message) {
    wire::Timing timing;
    timing.total_us =
        static_cast<uint64_t>(std::max<int64_t>(now_ns() - job.received_ns, 0) / 1000);
    observe(job, status, std::nullopt, timing);
    deliver(job, wire::write_infer_reply(job.request_id, status, message, std::nullopt, timing, 0),
            status);
}

void Plane::answer(int64_t job_id, int64_t status, const std::string& message,
                   const Finished* ran, const JobResult* result) {
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;  // answered already (a task that ran past the drain)
    Job& job = it->second;
    if (job.probe) {  // no client waits for it, and it holds no client's place
        jobs_.erase(it);
        pending_.store(static_cast<int64_t>(jobs_.size()));
        return;
    }
    const int64_t now = now_ns();
    wire::Timing timing;
    timing.total_us = static_cast<uint64_t>(std::max<int64_t>(now - job.received_ns, 0) / 1000);
    std::optional<std::string> device;
    if (ran != nullptr && ran->end_ns != 0) {
        timing.queue_us = static_cast<uint64_t>(
            std::max<int64_t>(job.dispatched_ns - job.received_ns, 0) / 1000);
        timing.device_us =
            static_cast<uint64_t>(std::max<int64_t>(ran->end_ns - ran->start_ns, 0) / 1000);
        timing.start_ns = static_cast<uint64_t>(ran->start_ns);
        timing.end_ns = static_cast<uint64_t>(ran->end_ns);
        device = job.device;
        if (result != nullptr) {  // the engine's pre/post-processing of the frame
            timing.pre_us = result->pre_us.value_or(0);
            timing.post_us = result->post_us.value_or(0);
        }
    }
    std::string shrunk;  // a client shrank the frame's segment while the frame was read
    if (status == OK && !job.segment.empty()) {
        const auto seg = segments_.find(job.segment);
        if (seg != segments_.end() &&
            shm_guard::broken(reinterpret_cast<uintptr_t>(seg->second.host))) {
            status = BAD_REQUEST;
            shrunk = "shm: the segment was truncated below its " +
                     std::to_string(seg->second.size) +
                     " bytes while this frame was read; a client must not resize a segment "
                     "in use";
        }
    }
    const std::string& said = shrunk.empty() ? message : shrunk;
    observe(job, status, device, timing);
    const std::string_view rows = status == OK && result != nullptr
                                      ? std::string_view(result->detections)
                                      : std::string_view();
    const uint64_t count = rows.size() / (6 * sizeof(float));
    const std::string header =
        wire::write_infer_reply(job.request_id, status, said, device, timing, count);
    // The job's place is freed before its reply leaves: whoever has the reply sees it gone
    // (pending, the client's cap, the counters).
    const Job answered = std::move(job);
    jobs_.erase(it);
    pending_.store(static_cast<int64_t>(jobs_.size()));
    const std::string key = key_of(answered.client, answered.request_id);
    if (--in_use_[key] <= 0) in_use_.erase(key);
    if (--in_flight_[answered.owner] <= 0) in_flight_.erase(answered.owner);
    buffered_ -= answered.size;
    buffered_bytes_.store(buffered_);
    if (!answered.segment.empty()) {
        const auto seg = segments_.find(answered.segment);
        if (seg != segments_.end()) {
            --seg->second.users;
            seg->second.last_used_ns = now;
        }
    }
    if (!answered.tag && answered.fd >= 0 &&
        generation_[answered.fd].load(std::memory_order_acquire) != answered.generation &&
        !newer_connection(answered.fd, answered.cookie)) {
        // its connection closed: a new one on its routing id must not get its reply (a
        // batch's image goes to the control plane all the same, which drops the batch's)
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.orphaned;
        return;
    }
    deliver(answered, header, status, rows);
}

void Plane::deliver(const Job& job, const std::string& header, int64_t status,
                    std::string_view detections) {
    if (!job.tag) {
        send_reply(job.client, header, detections.empty() ? nullptr : detections.data(),
                   detections.size(), status);
        return;
    }
    // an image of the control plane's request: its answer (and detections) goes back there
    Pending m{{}, {"", le64(*job.tag), le64(job.index), header, std::string(detections)}};
    if (backlog_.empty() && send_forward(m, kDontWait)) return;
    backlog_.push_back(std::move(m));
}

void Plane::observe(const Job& job, int64_t status, const std::optional<std::string>& device,
                    const wire::Timing& timing) {
    std::lock_guard<std::mutex> lock(mu_);
    if (observations_.size() >= kMaxObservations) {
        ++counters_.observations_lost;
        return;
    }
    observations_.push_back({job.model, device.value_or(""), status, timing.queue_us,
                             timing.device_us, timing.total_us});
}

void Plane::dispatch(int64_t now) {
    batch_wake_ns_.reset();
    update_loads(now);
    for (auto& [device, engine] : engines_) {
        int64_t& running = running_[device];
        while (running < engine->slots()) {
            std::vector<int64_t> ids;
            std::vector<int64_t> expired;
            if (engine->max_batch() > 1) {
                // Just in time: while a batch is on the engine, the next one is formed when
                // that one is expected to leave, less the time pre-processing takes (or when it
                // leaves), so that it takes what arrived meanwhile rather than the first frame.
                const int64_t ready_ns =
                    engine_free_ns_[device] - static_cast<int64_t>(pre_ns_[device]);
                if (running > 0 && now < ready_ns) {
                    if (!batch_wake_ns_ || ready_ns < *batch_wake_ns_) batch_wake_ns_ = ready_ns;
                    break;
                }
                BatchResult b = scheduler_.next_batch(device, engine->max_batch(),
                                                      batch_delay_us_[device], now);
                ids = std::move(b.jobs);
                if (!ids.empty()) {
                    const auto size = static_cast<int64_t>(ids.size());
                    const double us = scheduler_.service_us(device, size);
                    engine_free_ns_[device] =
                        std::max(engine_free_ns_[device], now) + static_cast<int64_t>(us * 1e3);
                }
                expired = std::move(b.expired);
                if (b.wait_until_ns && (!batch_wake_ns_ || *b.wait_until_ns < *batch_wake_ns_)) {
                    batch_wake_ns_ = b.wait_until_ns;  // a partial batch waits for more
                }
            } else {
                auto [head, gone] = scheduler_.next_job(device, now);
                if (head) ids.push_back(*head);
                expired = std::move(gone);
            }
            for (int64_t id : expired) {
                answer(id, DEADLINE_EXCEEDED, "deadline passed while queued");
            }
            if (ids.empty()) break;
            ++running;
            const int64_t cpu = thread_cpu_ns();
            engine->start(work_of(ids, now));
            const double per_frame =
                static_cast<double>(thread_cpu_ns() - cpu) / static_cast<double>(ids.size());
            double& start = start_ns_[device];
            start = start == 0.0 ? per_frame : start + 0.2 * (per_frame - start);
        }
    }
}

void Plane::update_loads(int64_t now) {
    if (load_since_ns_ != 0 && now - load_since_ns_ < 50'000'000) return;
    const int64_t cpu = thread_cpu_ns();
    if (load_since_ns_ != 0) {
        const auto wall = static_cast<double>(now - load_since_ns_);
        scheduler_.set_load("plane", static_cast<double>(cpu - load_cpu_ns_) / wall);
        for (auto& [resource, ns] : resource_busy_ns_) {
            scheduler_.set_load(resource, static_cast<double>(ns) / wall);
            ns = 0;
        }
    }
    load_since_ns_ = now;
    load_cpu_ns_ = cpu;
}

std::vector<Work> Plane::work_of(const std::vector<int64_t>& ids, int64_t now) {
    std::vector<Work> batch;
    batch.reserve(ids.size());
    for (int64_t id : ids) {
        Job& job = jobs_.at(id);
        job.dispatched_ns = now;
        Work w;
        w.job = id;
        w.image = job.image;
        // the model's settings where the INFER sets none (a max_det of 0 too): every engine
        // is handed resolved ones
        const ModelSettings& s = config_.settings.at(job.model);
        w.image.conf = job.image.conf.value_or(s.conf);
        w.image.iou = job.image.iou.value_or(s.iou);
        w.image.max_det = job.image.max_det.value_or(0) > 0 ? *job.image.max_det : s.max_det;
        if (job.payload) {
            w.host = job.payload->data();
            w.keep = job.payload;
        } else if (job.pixels) {
            w.host = reinterpret_cast<const uint8_t*>(job.pixels->data());
            w.keep = job.pixels;
        } else if (!job.segment.empty()) {
            const Segment& seg = segments_.at(job.segment);
            w.host = seg.host == nullptr ? nullptr : seg.host + job.shm_offset;
            w.device = seg.device == 0 ? 0 : seg.device + job.shm_offset;
        }
        batch.push_back(std::move(w));
    }
    return batch;
}

void Plane::finished(const std::string& device, const Finished& f) {
    const int64_t cpu = thread_cpu_ns();
    if (f.host_ns > 0) {
        auto busy = resource_busy_ns_.find(resource_[device]);
        if (busy != resource_busy_ns_.end()) busy->second += f.host_ns;
    }
    if (f.end_ns != 0) busy_ns_[device] += f.end_ns - f.start_ns;
    if (f.frees) --running_[device];
    if (f.frees && running_[device] == 0) engine_free_ns_[device] = 0;  // it left: idle now
    if (!f.results.empty() && f.results.front().pre_us) {  // a batch's pre-processing (EWMA)
        double& pre = pre_ns_[device];
        pre += 0.2 * (static_cast<double>(*f.results.front().pre_us) * 1e3 - pre);
    }
    std::vector<int64_t> ok;  // what the scheduler learns from: the jobs that went through
    for (size_t i = 0; i < f.jobs.size(); ++i) {
        const int64_t id = f.jobs[i];
        const JobResult* r = i < f.results.size() ? &f.results[i] : nullptr;
        const Failure failure = f.failure != Failure::none ? f.failure
                                : r != nullptr            ? r->failure
                                                          : Failure::none;
        if (jobs_.count(id) == 0) continue;  // answered SHUTTING_DOWN while it ran
        if (failure == Failure::none && jobs_.at(id).warm) {  // lazy set-up: nothing to learn
            scheduler_.released(device, id);
            answer(id, OK, "", &f, r);
            warmed(device, "", now_ns());
            continue;
        }
        if (failure == Failure::none) {
            ok.push_back(id);
            continue;
        }
        const std::string& words = f.failure != Failure::none ? f.message : r->message;
        if (jobs_.at(id).warm) {  // not the engine's failure yet: the warm-up's verdict
            scheduler_.released(device, id);
            answer(id, DEVICE_FAILED, words, &f, r);
            warmed(device, words, now_ns());
            continue;
        }
        scheduler_.finished(device, id, std::nullopt);  // a failure: its rate is learned
        if (failure == Failure::internal) {
            answer(id, INTERNAL, device + ": " + words, &f, r);
            continue;
        }
        const std::string why =
            device + ": " + (failure == Failure::gpu ? "the GPU chain could not be queued: " : "") +
            words;
        ++failed_[device];
        ++failing_[device];
        last_failure_[device] = why;
        if (failure == Failure::gpu) {
            std::lock_guard<std::mutex> lock(mu_);
            ++counters_.gpu_errors;
            counters_.last_gpu_error = device + ": " + words;
        }
        const int64_t now = now_ns();
        if (jobs_.at(id).probe) {
            probe_ended(device, false, why, now);
            answer(id, DEVICE_FAILED, why, &f, r);  // a probe's: no reply
        } else if (!retry(id, device, why)) {
            answer(id, DEVICE_FAILED, why, &f, r);
        }
        // a hang quarantines at once, failures after quarantine_after in a row
        const int64_t n = config_.health.quarantine_after;
        if (!watches_[device].quarantined && n > 0) {
            if (failure == Failure::hung) {
                quarantine_now(device, "a task hung: " + why, now);
            } else if (failing_[device] >= n) {
                quarantine_now(device,
                               std::to_string(failing_[device]) +
                                   " tasks failed in a row; last: " + why,
                               now);
            }
        }
    }
    if (ok.empty()) return;
    failing_[device] = 0;  // a frame that went through: the device serves again
    const double device_us = static_cast<double>(f.end_ns - f.start_ns) / 1e3;
    if (ok.size() == 1 && f.jobs.size() == 1) {
        scheduler_.finished(device, ok.front(), device_us);
    } else {
        scheduler_.finished_batch(device, ok, device_us);
    }
    for (size_t i = 0; i < f.jobs.size(); ++i) {
        if (std::find(ok.begin(), ok.end(), f.jobs[i]) == ok.end()) continue;
        if (jobs_.at(f.jobs[i]).probe) probe_ended(device, true, "", now_ns());
        answer(f.jobs[i], OK, "", &f, i < f.results.size() ? &f.results[i] : nullptr);
    }
    // what the frames cost the host: this thread's start() and answers, the engine's threads
    const auto frames = static_cast<int64_t>(ok.size());
    const double plane_ns =
        static_cast<double>(thread_cpu_ns() - cpu) + start_ns_[device] * static_cast<double>(frames);
    scheduler_.host(device, frames, plane_ns + static_cast<double>(f.host_ns));
}

bool Plane::retry(int64_t job_id, const std::string& failed_on, const std::string& why) {
    Job& job = jobs_.at(job_id);
    if (!config_.health.retry || job.retried) return false;
    const int64_t now = now_ns();
    // too late, or a newer frame of its stream waits: that one counts
    if (now >= job.spec.deadline_ns || scheduler_.has_queued(job.spec.stream, job.spec.owner)) {
        return false;
    }
    const AdmitResult r = scheduler_.admit(job.spec, {failed_on}, now);
    if (r.refusal != Refusal::none) return false;
    job.retried = true;
    job.device = r.placed.device;
    HealthEvent e;
    e.kind = HealthEvent::retried;
    e.device = failed_on;
    e.reason = why;
    e.client = job.client;
    e.request_id = job.request_id;
    e.to = job.device;
    event(std::move(e));
    return true;
}

void Plane::quarantine_now(const std::string& device, const std::string& reason, int64_t now) {
    Watch& w = watches_.at(device);
    w.quarantined = true;
    w.reason = reason.substr(0, 200);
    w.since_ns = now;
    ++w.quarantines;
    w.rest_s = config_.health.probe_after_s;
    w.probe_at_ns = now + static_cast<int64_t>(w.rest_s * 1e9);
    const std::vector<int64_t> moved = scheduler_.set_available(device, false);
    HealthEvent e;
    e.kind = HealthEvent::quarantined;
    e.device = device;
    e.reason = w.reason;
    e.seconds = static_cast<double>(moved.size());
    event(std::move(e));
    // Its queued frames go to the model's other engines, or are answered
    for (int64_t id : moved) {
        auto it = jobs_.find(id);
        if (it == jobs_.end()) continue;
        Job& job = it->second;  // not a probe: one is queued only while its engine is out
        if (job.warm) {  // a warm-up still queued: it never ran
            answer(id, DEVICE_FAILED, "");
            warmed(device, "quarantined before it ran", now);
            continue;
        }
        const AdmitResult r = scheduler_.admit(job.spec, {device}, now);
        if (r.refusal != Refusal::none) {
            const auto [status, why] = refusal(r, job.spec.model, id);
            answer(id, status, why);
            continue;
        }
        job.device = r.placed.device;
    }
}

void Plane::start_probes(int64_t now) {
    for (auto& [device, w] : watches_) {
        if (!w.quarantined || w.probe >= 0 || w.probe_at_ns > now) continue;
        w.probe = place_blank(device, false, now);
    }
}

int64_t Plane::place_blank(const std::string& device, bool warm, int64_t now) {
    const auto model = first_model_.find(device);
    if (model == first_model_.end()) return -1;  // serving no model: nothing to run
    // one task on a blank frame, for this engine alone
    static const auto blank = std::make_shared<const std::string>(64 * 64 * 3, '\0');
    Job job;
    job.probe = true;
    job.warm = warm;
    job.model = model->second;
    job.received_ns = now;
    job.image = {64, 64, 3, false, 0.25, 0.45, 1};
    job.pixels = blank;
    job.spec = {next_job_++, job.model, now + kProbeDeadlineNs, 0, std::nullopt, ""};
    Placed placed;
    if (!scheduler_.admit_probe(device, job.spec, now, &placed)) return -1;
    job.device = device;
    const int64_t id = job.spec.id;
    jobs_.emplace(id, std::move(job));
    pending_.store(static_cast<int64_t>(jobs_.size()));
    return id;
}

void Plane::warm_up(const std::vector<std::string>& devices) {
    std::string unknown;
    call([&] {
        const int64_t now = now_ns();
        for (const auto& device : devices) {
            if (watches_.count(device) == 0) {
                unknown = device;
                return;
            }
            if (place_blank(device, true, now) < 0) warmed(device, "", now);  // nothing to run
        }
    });
    if (!unknown.empty()) throw UnknownDevice(unknown);
}

void Plane::warmed(const std::string& device, const std::string& why, int64_t now) {
    HealthEvent e;
    e.kind = HealthEvent::warmed;
    e.device = device;
    e.reason = why;
    event(std::move(e));
    if (!why.empty() && config_.health.quarantine_after > 0 && !watches_[device].quarantined) {
        quarantine_now(device, "warm-up failed: " + why, now);
    }
}

void Plane::probe_ended(const std::string& device, bool ok, const std::string& why, int64_t now) {
    Watch& w = watches_.at(device);
    w.probe = -1;
    HealthEvent e;
    e.device = device;
    if (ok) {
        e.kind = HealthEvent::returned;
        e.seconds = static_cast<double>(now - w.since_ns) / 1e9;
        w.quarantined = false;
        w.reason.clear();
        scheduler_.set_available(device, true);
    } else {
        w.rest_s = std::min(2 * w.rest_s, config_.health.probe_max_s);
        w.probe_at_ns = now + static_cast<int64_t>(w.rest_s * 1e9);
        e.kind = HealthEvent::probe_failed;
        e.reason = why.substr(0, 200);
        e.seconds = w.rest_s;
    }
    event(std::move(e));
}

void Plane::event(HealthEvent e) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (events_.size() < kMaxObservations) events_.push_back(std::move(e));
        if (events_signalled_) return;
        events_signalled_ = true;
    }
    // tell the control plane, once until it takes them: ["", "health"] on the forward socket
    Pending m{{}, {"", "health"}};
    if (backlog_.empty() && send_forward(m, kDontWait)) return;
    backlog_.push_back(std::move(m));
}

void Plane::quarantine(const std::string& device, const std::string& reason) {
    bool known = true;
    call([&] {
        const auto w = watches_.find(device);
        if (w == watches_.end()) {
            known = false;
        } else if (!w->second.quarantined) {
            quarantine_now(device, reason, now_ns());
        }
    });
    if (!known) throw UnknownDevice(device);
}

bool Plane::probe_now(const std::string& device) {
    bool known = true;
    bool quarantined = false;
    call([&] {
        const auto w = watches_.find(device);
        if (w == watches_.end()) {
            known = false;
            return;
        }
        quarantined = w->second.quarantined;
        if (quarantined) {
            const int64_t now = now_ns();
            w->second.probe_at_ns = std::min(w->second.probe_at_ns, now);
            start_probes(now);
        }
    });
    if (!known) throw UnknownDevice(device);
    return quarantined;
}

std::vector<HealthEvent> Plane::take_events() {
    std::vector<HealthEvent> out;
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(events_);
    events_signalled_ = false;
    return out;
}

void Plane::take_completions() {
    std::vector<std::pair<std::string, Finished>> done;
    {
        std::lock_guard<std::mutex> lock(mu_);
        done.swap(done_);
    }
    for (const auto& [device, f] : done) finished(device, f);
}

void Plane::send_outbox() {
    std::vector<std::pair<std::string, std::vector<std::string>>> out;
    {
        std::lock_guard<std::mutex> lock(mu_);
        out.swap(outbox_);
    }
    for (const auto& [client, frames] : out) {
        bool ok = api_.send(router_, client.data(), client.size(), kDontWait | kSndMore) >= 0;
        for (size_t i = 0; ok && i < frames.size(); ++i) {
            const int flags = kDontWait | (i + 1 < frames.size() ? kSndMore : 0);
            ok = api_.send(router_, frames[i].data(), frames[i].size(), flags) >= 0;
        }
        if (!ok) {
            std::lock_guard<std::mutex> lock(mu_);
            ++counters_.dropped;
        }
    }
}

void Plane::send_reply(const std::string& client, const std::string& header, const void* payload,
                       size_t payload_bytes, int64_t status, bool payload_frame) {
    // ROUTER_MANDATORY (set by the frontend): a reply that cannot be queued fails here instead
    // of vanishing, and is counted
    // Counted before it leaves: whoever has the reply sees it counted.
    {
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.replied;
        ++counters_.by_status[status_name(status)];
    }
    static const char none = 0;
    const int last = payload_frame ? kSndMore : 0;
    const bool ok =
        api_.send(router_, client.data(), client.size(), kDontWait | kSndMore) >= 0 &&
        api_.send(router_, header.data(), header.size(), kDontWait | last) >= 0 &&
        (!payload_frame || api_.send(router_, payload ? payload : &none, payload_bytes, kDontWait) >= 0);
    if (!ok) {
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.dropped;
    }
}

}  // namespace dlad::plane
