// The scheduler (scheduler.hpp states its policy).
#include "scheduler.hpp"

#include <algorithm>
#include <functional>

namespace dlad {

namespace {

// Python compares a float with an int exactly; a long double holds both exactly (x86's 64-bit
// mantissa, aarch64's 113-bit one).
bool greater(double x, int64_t n) {
    return static_cast<long double>(x) > static_cast<long double>(n);
}

// Python's min(a, b) and max(a, b): the first argument unless the second is strictly beyond it.
double py_min(double a, double b) { return b < a ? b : a; }
double py_max(double a, double b) { return b > a ? b : a; }

int64_t trunc(double x) { return static_cast<int64_t>(x); }  // int(x): toward zero

}  // namespace

// ---------------------------------------------------------------------------- Curve (_Curve)
double Curve::operator()(int64_t size) const {  // curves.interpolate
    auto it = known_.lower_bound(size);
    if (it != known_.end() && it->first == size) return it->second;
    if (it == known_.begin()) {
        return it->second * static_cast<double>(size) / static_cast<double>(it->first);
    }
    if (it == known_.end()) {
        auto last = std::prev(it);
        return last->second * static_cast<double>(size) / static_cast<double>(last->first);
    }
    auto lo = std::prev(it);
    double frac = static_cast<double>(size - lo->first) / static_cast<double>(it->first - lo->first);
    return lo->second + frac * (it->second - lo->second);
}

void Curve::learn(int64_t size, double measured_ns) {
    double old = (*this)(size);
    double sample = py_min(py_max(measured_ns, old / kLearnClamp), old * kLearnClamp);
    known_[size] = old + alpha_ * (sample - old);
}

// ---------------------------------------------------------------------------- _Device
bool Scheduler::Device::serves(const std::string& model) const {
    return std::find(models.begin(), models.end(), model) != models.end();
}

double Scheduler::Device::work_ns(int64_t jobs, const Curve* c) const {
    if (jobs <= 0) return 0.0;
    const Curve& curve_ = c ? *c : curve;
    if (max_batch == 1) return static_cast<double>(jobs) * curve_.at1();
    int64_t full = jobs / max_batch, rest = jobs % max_batch;
    return static_cast<double>(full) * curve_(max_batch) + (rest ? curve_(rest) : 0.0);
}

// ---------------------------------------------------------------------------- configuration
Scheduler::Scheduler(double alpha, Policy policy_,
                     std::vector<std::tuple<std::string, std::string, double>> interference,
                     std::unordered_map<std::string, std::string> pins)
    : policy(policy_), alpha_(alpha), by_hand_(std::move(pins)) {
    for (auto& [victim, aggressor, k] : interference) {
        if (k > 0) interference_[{victim, aggressor}] = k;
    }
}

const Scheduler::Device& Scheduler::dev(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw UnknownDevice(name);
    return devices_[it->second];
}

Scheduler::Device& Scheduler::dev(const std::string& name) {
    return const_cast<Device&>(static_cast<const Scheduler*>(this)->dev(name));
}

void Scheduler::add_device(const std::string& name, const std::vector<std::string>& models,
                           int64_t capacity, int64_t max_batch,
                           const std::map<int64_t, double>& known_ns, int64_t tier,
                           const std::string& kind) {
    if (index_.count(name)) throw std::invalid_argument("device " + name + " registered twice");
    if (!known_ns.count(1)) throw std::invalid_argument(name + ": no service time at batch 1");
    Curve curve(known_ns, alpha_);
    Device d{name, models, capacity, max_batch, curve, curve, tier, kind};
    d.batches.assign(static_cast<size_t>(max_batch), 0);
    index_[name] = devices_.size();
    devices_.push_back(std::move(d));
    // What admission reads for every job, kept as the devices are registered.
    serving_.clear();
    for (size_t i = 0; i < devices_.size(); ++i) {
        for (const auto& m : devices_[i].models) {
            auto& list = serving_[m];
            if (list.empty() || list.back() != i) list.push_back(i);
        }
    }
    victims_.assign(devices_.size(), {});
    for (size_t d_ = 0; d_ < devices_.size(); ++d_) {
        for (size_t e = 0; e < devices_.size(); ++e) {
            if (e == d_) continue;
            auto it = interference_.find({devices_[e].kind, devices_[d_].kind});
            if (it != interference_.end()) victims_[d_].emplace_back(e, it->second);
        }
    }
}

std::vector<std::string> Scheduler::models() const {
    std::vector<std::string> out;
    for (const auto& [m, _] : serving_) out.push_back(m);
    std::sort(out.begin(), out.end());
    return out;
}

// ---------------------------------------------------------------------------- admission
AdmitResult Scheduler::admit(const JobSpec& job, const std::vector<std::string>& avoid,
                             int64_t now) {
    AdmitResult r;
    if (jobs_.count(job.id)) {
        r.refusal = Refusal::duplicate;
        return r;
    }
    auto sv = serving_.find(job.model);
    if (sv == serving_.end() || sv->second.empty()) {
        r.refusal = Refusal::not_found;
        return r;
    }
    const std::vector<size_t>& serving = sv->second;
    auto avoided = [&](const Device& d) {
        return std::find(avoid.begin(), avoid.end(), d.name) != avoid.end();
    };
    std::vector<size_t> candidates;
    if (!avoid.empty() || out_) {
        for (size_t i : serving) {
            if (devices_[i].available && !avoided(devices_[i])) candidates.push_back(i);
        }
    } else {
        candidates = serving;
    }
    if (candidates.empty()) {
        r.refusal = Refusal::device_failed;
        for (size_t i : serving) r.unhealthy.emplace_back(devices_[i].name, avoided(devices_[i]));
        return r;
    }
    std::optional<Key> key;
    if (job.stream) key = Key{job.owner, *job.stream};
    if (policy == Policy::statik && key) candidates = {pin(*key, candidates)};
    // The stream's queued frame (if any) is superseded only once the new one is sure to be
    // admitted: a refused new frame leaves the old one queued.
    const Job* old = nullptr;
    if (key) {
        auto s = streams_.find(*key);
        if (s != streams_.end()) {
            auto j = jobs_.find(s->second);
            if (j != jobs_.end()) old = &j->second;
        }
    }
    std::vector<size_t> open;
    for (size_t i : candidates) {
        const Device& d = devices_[i];
        if (d.capacity - d.depth + (old && old->device == i ? 1 : 0) > 0) open.push_back(i);
    }
    if (open.empty()) {
        r.refusal = Refusal::overloaded;
        for (size_t i : candidates) {
            r.full.push_back({devices_[i].name, devices_[i].depth, devices_[i].capacity});
        }
        return r;
    }
    if (old) {
        int64_t id = old->spec.id;
        remove(id);
        r.superseded.push_back(id);
    }
    r.placed = enqueue(choose(job, open, now), job, now);
    if (key) streams_[*key] = job.id;
    return r;
}

std::optional<int64_t> Scheduler::displace_for(const JobSpec& job) {
    std::vector<bool> places(devices_.size(), false);
    std::vector<size_t> where;
    for (size_t i = 0; i < devices_.size(); ++i) {
        if (devices_[i].serves(job.model) && devices_[i].available) where.push_back(i);
    }
    if (where.empty()) return std::nullopt;
    if (policy == Policy::statik && job.stream) where = {pin(Key{job.owner, *job.stream}, where)};
    for (size_t i : where) places[i] = true;
    auto held_by = [&](const std::string& owner) {
        auto it = owned_.find(owner);
        return it == owned_.end() ? int64_t{0} : it->second;
    };
    int64_t mine = held_by(job.owner);
    const Job* victim = nullptr;
    int64_t victim_held = 0;
    for (const auto& [seq, id] : order_) {
        const Job& other = jobs_.at(id);
        int64_t held = held_by(other.spec.owner);
        if (places[other.device] && other.spec.priority <= job.priority && other.spec.id >= 0 &&
            held >= mine + 2 &&
            (!victim || std::make_pair(held, other.seq) > std::make_pair(victim_held, victim->seq))) {
            victim = &other;
            victim_held = held;
        }
    }
    if (!victim) return std::nullopt;
    int64_t id = victim->spec.id;
    remove(id);
    return id;
}

std::optional<std::string> Scheduler::pinned(const std::string& stream,
                                             const std::string& owner) const {
    auto it = pin_at_.find(Key{owner, stream});
    if (it == pin_at_.end()) return std::nullopt;
    return it->second->second;
}

size_t Scheduler::choose(const JobSpec& job, const std::vector<size_t>& open, int64_t now) const {
    // Each device's work in flight, read once (the interference term reads the others').
    bool interference = !interference_.empty();
    std::vector<double> left(devices_.size(), 0.0);
    if (interference) {
        for (size_t i = 0; i < devices_.size(); ++i) {
            left[i] = static_cast<double>(in_flight_ns(devices_[i], now));
        }
    } else {
        for (size_t i : open) left[i] = static_cast<double>(in_flight_ns(devices_[i], now));
    }
    size_t best = open.front();
    bool best_late = false;
    double best_end = 0.0;
    int64_t best_tier = 0;
    bool best_full = false;
    double best_host = 0.0;
    bool first = true;
    for (size_t i : open) {
        const Device& d = devices_[i];
        // A device whose tasks fail needs 1 / (1 - f) attempts a success: it must not win
        // frames because failing is quick.
        double end = (left[i] + d.work_ns(d.depth + 1)) / (1 - py_min(d.fail_rate, 0.95));
        bool late = greater(static_cast<double>(now) + end, job.deadline_ns);
        bool better;
        if (policy == Policy::throughput) {
            // the host first: a saturated resource bounds the daemon, and there the frame
            // that costs it least serves the most
            const bool full = load(d.resource) >= kSaturated;
            const double host = full ? d.host_ns : 0.0;
            better = first || std::tie(late, full, host, d.tier, end, d.name) <
                                  std::tie(best_late, best_full, best_host, best_tier, best_end,
                                           devices_[best].name);
            if (better) best_full = full, best_host = host;
        } else if (!interference) {
            late = false;
            better = first || std::tie(end, d.name) < std::tie(best_end, devices_[best].name);
        } else {
            end = end + induced_ns(i, left);
            better = first ||
                     std::tie(late, end, d.name) < std::tie(best_late, best_end, devices_[best].name);
        }
        if (better) {
            best = i, best_late = late, best_end = end, best_tier = d.tier;
            first = false;
        }
    }
    return best;
}

double Scheduler::induced_ns(size_t i, const std::vector<double>& left) const {
    const Device& d = devices_[i];
    double extra;
    if (d.max_batch == 1) {
        extra = d.seed.at1();
    } else {
        extra = d.work_ns(d.depth + 1, &d.seed) - d.work_ns(d.depth, &d.seed);
    }
    double total = 0.0;
    for (const auto& [e_, k] : victims_[i]) {
        const Device& e = devices_[e_];
        int64_t held = e.depth + static_cast<int64_t>(e.running.size());
        if (held) {  // until e's current work is done
            double queued = e.max_batch == 1 ? static_cast<double>(e.depth) * e.curve.at1()
                                             : e.work_ns(e.depth);
            total += static_cast<double>(held) * k * py_min(extra, left[e_] + queued);
        }
    }
    return total;
}

size_t Scheduler::pin(const Key& stream, const std::vector<size_t>& candidates) {  // _pinned
    auto at = pin_at_.find(stream);
    std::optional<std::string> name;
    if (at != pin_at_.end()) name = at->second->second;
    if (name) {
        for (size_t i : candidates) {
            if (devices_[i].name == *name) {
                pins_.splice(pins_.end(), pins_, at->second);
                return i;
            }
        }
    }
    auto load = [&](const Device& d) {
        return static_cast<double>(d.pinned + 1) * d.curve(d.max_batch) /
               static_cast<double>(d.max_batch);
    };
    std::optional<size_t> chosen;
    auto hand = by_hand_.find(stream.second);
    if (hand != by_hand_.end()) {
        for (size_t i : candidates) {
            if (devices_[i].name == hand->second) chosen = i;
        }
    }
    if (!chosen) {
        for (size_t i : candidates) {
            if (!chosen || std::make_pair(load(devices_[i]), devices_[i].name) <
                               std::make_pair(load(devices_[*chosen]), devices_[*chosen].name)) {
                chosen = i;
            }
        }
    }
    Device& c = devices_[*chosen];
    if (name) {
        dev(*name).pinned -= 1;
        at->second->second = c.name;
        pins_.splice(pins_.end(), pins_, at->second);
    } else {
        pins_.emplace_back(stream, c.name);
        pin_at_[stream] = std::prev(pins_.end());
    }
    c.pinned += 1;
    while (pins_.size() > kMaxPinnedStreams) {
        dev(pins_.front().second).pinned -= 1;
        pin_at_.erase(pins_.front().first);
        pins_.pop_front();
    }
    return *chosen;
}

int64_t Scheduler::in_flight_ns(const Device& d, int64_t now) {
    int64_t left = 0;
    if (d.max_batch > 1) {  // a batch's jobs share one task: count it once
        std::map<int64_t, int64_t> tasks;
        for (const auto& [_, r] : d.running) tasks[r.task] = r.start + r.est;
        for (const auto& [_, end] : tasks) left += std::max<int64_t>(end - now, 0);
        return left;
    }
    for (const auto& [_, r] : d.running) {
        if (r.start + r.est > now) left += r.start + r.est - now;
    }
    return left;
}

// ---------------------------------------------------------------------------- dispatch
std::pair<std::optional<int64_t>, std::vector<int64_t>> Scheduler::next_job(
    const std::string& device, int64_t now) {
    return pop(dev(device), now);
}

std::pair<std::optional<int64_t>, std::vector<int64_t>> Scheduler::pop(Device& d, int64_t now) {
    std::vector<int64_t> expired;
    while (!d.heap.empty()) {
        std::pop_heap(d.heap.begin(), d.heap.end(), std::greater<Entry>());
        Entry e = d.heap.back();
        d.heap.pop_back();
        auto j = jobs_.find(e.id);
        if (j == jobs_.end() || j->second.seq != e.seq) continue;  // removed while queued
        take(e.id);
        if (e.deadline <= now) {
            expired.push_back(e.id);
            continue;
        }
        d.running[e.id] = {now, trunc(d.curve.at1()), tasks_++};
        return {e.id, expired};
    }
    return {std::nullopt, expired};
}

BatchResult Scheduler::next_batch(const std::string& device, std::optional<int64_t> max_batch,
                                  double max_queue_delay_us, int64_t now) {
    Device& d = dev(device);
    int64_t size = max_batch ? *max_batch : d.max_batch;
    if (size < 1 || max_queue_delay_us < 0) {
        throw std::invalid_argument("max_batch must be >= 1 and max_queue_delay_us >= 0");
    }
    BatchResult b;
    if (size == 1) {
        auto [head, stale] = pop(d, now);
        if (head) b.jobs.push_back(*head);
        b.expired = std::move(stale);
        return b;
    }
    std::vector<Entry> sorted = d.heap;
    std::sort(sorted.begin(), sorted.end());
    std::vector<Entry> live;
    for (const Entry& e : sorted) {
        auto j = jobs_.find(e.id);
        if (j == jobs_.end() || j->second.seq != e.seq) continue;  // removed while queued
        if (e.deadline <= now) {
            take(e.id);
            b.expired.push_back(e.id);
        } else {
            live.push_back(e);
        }
    }
    d.heap = live;  // sorted: a heap
    if (live.empty()) return b;
    const Job& head = jobs_.at(live.front().id);
    std::vector<int64_t> chosen;
    for (const Entry& e : live) {
        if (static_cast<int64_t>(chosen.size()) == size) break;
        if (jobs_.at(e.id).spec.model == head.spec.model) chosen.push_back(e.id);
    }
    if (static_cast<int64_t>(chosen.size()) < size) {
        double full_ns = d.curve(size);
        int64_t latest = head.admitted_ns + trunc(max_queue_delay_us * 1e3);
        for (int64_t id : chosen) {
            latest = std::min(latest,
                              trunc(static_cast<double>(jobs_.at(id).spec.deadline_ns) - full_ns));
        }
        if (now < latest) {
            b.wait_until_ns = latest;
            return b;
        }
    }
    int64_t task = tasks_++;
    int64_t est = trunc(d.curve(static_cast<int64_t>(chosen.size())));
    for (int64_t id : chosen) {
        take(id);
        d.running[id] = {now, est, task};
    }
    std::vector<Entry> rest;
    for (const Entry& e : d.heap) {
        if (std::find(chosen.begin(), chosen.end(), e.id) == chosen.end()) rest.push_back(e);
    }
    d.heap = std::move(rest);
    b.jobs = std::move(chosen);
    return b;
}

void Scheduler::finished(const std::string& device, int64_t job, std::optional<double> device_us) {
    Device& d = dev(device);
    d.running.erase(job);
    learn(d, 1, device_us);
}

void Scheduler::released(const std::string& device, int64_t job) { dev(device).running.erase(job); }

void Scheduler::finished_batch(const std::string& device, const std::vector<int64_t>& jobs,
                               std::optional<double> device_us) {
    Device& d = dev(device);
    for (int64_t id : jobs) d.running.erase(id);
    if (!jobs.empty()) learn(d, static_cast<int64_t>(jobs.size()), device_us);
}

void Scheduler::set_resource(const std::string& device, const std::string& resource) {
    dev(device).resource = resource;
}

void Scheduler::host(const std::string& device, int64_t frames, double host_ns) {
    if (frames < 1 || !(host_ns >= 0)) return;
    Device& d = dev(device);
    const double per_frame = host_ns / static_cast<double>(frames);
    d.host_ns = d.host_ns == 0.0 ? per_frame : d.host_ns + alpha_ * (per_frame - d.host_ns);
}

void Scheduler::set_load(const std::string& resource, double fraction) {
    loads_[resource] = fraction;
}

double Scheduler::load(const std::string& resource) const {
    auto it = loads_.find(resource);
    return it == loads_.end() ? 0.0 : it->second;
}

void Scheduler::learn(Device& d, int64_t size, std::optional<double> device_us) {
    d.fail_rate += alpha_ * ((device_us ? 0.0 : 1.0) - d.fail_rate);
    if (device_us && *device_us > 0) {
        d.curve.learn(size, *device_us * 1e3);
        d.completed += size;
        d.batches[static_cast<size_t>(std::min(size, d.max_batch) - 1)] += 1;
    }
}

std::vector<int64_t> Scheduler::set_available(const std::string& device, bool available) {
    Device& d = dev(device);
    if (d.available != available) out_ += available ? -1 : 1;
    d.available = available;
    if (available) return {};
    size_t at = index_.at(device);
    std::vector<Entry> queued;
    for (const auto& [id, j] : jobs_) {
        if (j.device == at) queued.push_back({-j.spec.priority, j.spec.deadline_ns, j.seq, id});
    }
    std::sort(queued.begin(), queued.end());
    std::vector<int64_t> ids;
    for (const Entry& e : queued) {
        remove(e.id);
        ids.push_back(e.id);
    }
    return ids;
}

bool Scheduler::admit_probe(const std::string& device, const JobSpec& job, int64_t now,
                            Placed* placed) {
    if (jobs_.count(job.id)) return false;
    auto at = index_.find(device);
    if (at == index_.end()) throw UnknownDevice(device);
    JobSpec probe = job;
    probe.stream.reset();
    *placed = enqueue(at->second, probe, now);
    return true;
}

Placed Scheduler::enqueue(size_t i, const JobSpec& spec, int64_t now) {
    Device& d = devices_[i];
    Job j{spec, i, now, trunc(d.curve.at1()), seq_++};
    d.heap.push_back({-spec.priority, spec.deadline_ns, j.seq, spec.id});
    std::push_heap(d.heap.begin(), d.heap.end(), std::greater<Entry>());
    d.depth += 1;
    order_[j.seq] = spec.id;
    owned_[spec.owner] += 1;
    Placed p{d.name, j.admitted_ns, j.estimate_ns, j.seq};
    jobs_.emplace(spec.id, std::move(j));
    return p;
}

std::vector<int64_t> Scheduler::expire(int64_t now) {
    std::vector<int64_t> gone;
    for (const auto& [seq, id] : order_) {
        if (jobs_.at(id).spec.deadline_ns <= now) gone.push_back(id);
    }
    for (int64_t id : gone) remove(id);
    return gone;
}

std::optional<int64_t> Scheduler::earliest_deadline() const {
    std::optional<int64_t> best;
    for (const auto& [id, j] : jobs_) {
        if (!best || j.spec.deadline_ns < *best) best = j.spec.deadline_ns;
    }
    return best;
}

bool Scheduler::cancel(int64_t id) { return remove(id); }

std::vector<int64_t> Scheduler::drain() {
    std::vector<int64_t> ids;
    for (const auto& [seq, id] : order_) ids.push_back(id);
    for (int64_t id : ids) remove(id);
    return ids;
}

// ---------------------------------------------------------------------------- state
bool Scheduler::has_queued(const std::optional<std::string>& stream,
                           const std::string& owner) const {
    return stream && streams_.count(Key{owner, *stream});
}

std::vector<Snapshot> Scheduler::snapshot() const {
    std::vector<Snapshot> out;
    for (const Device& d : devices_) {
        out.push_back({d.name, d.depth, d.capacity, static_cast<int64_t>(d.running.size()),
                       d.curve(1) / 1e3, d.completed, d.max_batch, d.batches, d.available,
                       d.host_ns / 1e3, d.resource});
    }
    return out;
}

bool Scheduler::remove(int64_t id) {  // _remove
    if (!jobs_.count(id)) return false;
    Device& d = devices_[take(id)];
    // Compact when stale entries dominate, so the heap stays O(capacity).
    if (static_cast<int64_t>(d.heap.size()) > 2 * d.capacity) {
        std::vector<Entry> live;
        for (const Entry& e : d.heap) {
            auto j = jobs_.find(e.id);
            if (j != jobs_.end() && j->second.seq == e.seq) live.push_back(e);
        }
        d.heap = std::move(live);
        std::make_heap(d.heap.begin(), d.heap.end(), std::greater<Entry>());
    }
    return true;
}

size_t Scheduler::take(int64_t id) {  // _take: the job leaves its queue
    auto j = jobs_.find(id);
    size_t at = j->second.device;
    Device& d = devices_[at];
    d.depth -= 1;
    const JobSpec& spec = j->second.spec;
    auto own = owned_.find(spec.owner);
    if (--own->second == 0) owned_.erase(own);
    if (spec.stream) {
        auto s = streams_.find(Key{spec.owner, *spec.stream});
        if (s != streams_.end() && s->second == id) streams_.erase(s);
    }
    order_.erase(j->second.seq);
    jobs_.erase(j);
    return at;
}

}  // namespace dlad
