// Pipeline schedules and their timeline: DynaPipe (seed dynapipe.txt) §5, Algorithm 1.
// Mirrors dynapipe_planner/schedule/*_reference op for op (same float arithmetic, same error
// messages); the schedule search calls these once per candidate, so they must be cheap.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Order = std::vector<int64_t>;
using Orders = std::vector<Order>;
using Matrix = py::array_t<double, py::array::c_style | py::array::forcecast>;

std::string describe_op(int64_t code) {
  return std::string(code % 2 ? "backward" : "forward") + " of micro-batch " +
         std::to_string(code / 2);
}

// Same text as Python's f"{value:.0f}".
std::string format_bytes(double value) {
  std::vector<char> text(std::snprintf(nullptr, 0, "%.0f", value) + 1);
  std::snprintf(text.data(), text.size(), "%.0f", value);
  return text.data();
}

// Row-major (rows, cols) view of a checked numpy matrix; the data outlives the GIL release
// because the caller's array keeps it alive.
struct View {
  const double* data;
  int64_t cols;
  double operator()(int64_t row, int64_t col) const { return data[row * cols + col]; }
};

View view(const Matrix& m, int64_t rows, int64_t cols, const char* name) {
  if (m.ndim() != 2 || m.shape(0) != rows || m.shape(1) != cols) {
    throw std::invalid_argument(std::string(name) + ": shape does not match the pipeline");
  }
  return View{m.data(), cols};
}

// (micro-batches, stages) of the (M, C) matrix `m` that sizes a pipeline: at least one stage.
std::pair<int64_t, int64_t> pipeline_dims(const Matrix& m, const char* name) {
  if (m.ndim() != 2) throw std::invalid_argument(std::string(name) + " must be (M, C)");
  if (m.shape(1) < 1) {
    throw std::invalid_argument(std::string(name) + " must have at least one stage");
  }
  return {m.shape(0), m.shape(1)};
}

void check_limit(const Matrix& limit, int64_t num_stages) {
  if (limit.ndim() != 1 || limit.shape(0) != num_stages) {
    throw std::invalid_argument("limit: shape does not match the pipeline");
  }
}

Orders one_f_one_b(int64_t num_stages, int64_t num_mb) {
  Orders orders(num_stages);
  for (int64_t stage = 0; stage < num_stages; ++stage) {
    Order& order = orders[stage];
    const int64_t warmup = std::min(num_stages - stage - 1, num_mb);
    for (int64_t m = 0; m < warmup; ++m) order.push_back(2 * m);
    for (int64_t step = 0; step < num_mb - warmup; ++step) {
      order.push_back(2 * (warmup + step));
      order.push_back(2 * step + 1);
    }
    for (int64_t m = num_mb - warmup; m < num_mb; ++m) order.push_back(2 * m + 1);
  }
  return orders;
}

// A FIFO of ready micro-batches; each is pushed at most once, so a vector and a head suffice.
struct ReadyQueue {
  std::vector<int64_t> items;
  size_t head = 0;
  bool empty() const { return head == items.size(); }
  int64_t front() const { return items[head]; }
};

// A forward is admitted when stored + its activation + the largest transient among it and the
// micro-batches the stage holds fits the limit (see adaptive.py for why every op then fits).
Orders adaptive_schedule(View act, View transient, const double* limit, int64_t num_mb,
                         int64_t num_stages, std::optional<int64_t> max_inflight) {
  std::vector<ReadyQueue> forward_ready(num_stages), backward_ready(num_stages);
  for (int64_t m = 0; m < num_mb; ++m) forward_ready[0].items.push_back(m);
  std::vector<double> memory(num_stages, 0.0);
  // Transients of the micro-batches each stage holds; stage 0's count is those in flight.
  std::vector<std::multiset<double>> held(num_stages);
  Orders orders(num_stages);
  // At most one op per buffer is unlocked per cycle: one forward from the stage above, one
  // backward from the stage below (or, on the last stage, from its own forward).
  std::vector<int64_t> unlocked_forward(num_stages), unlocked_backward(num_stages);
  auto pending = [&] {
    for (int64_t j = 0; j < num_stages; ++j) {
      if (!forward_ready[j].empty() || !backward_ready[j].empty()) return true;
    }
    return false;
  };

  while (pending()) {
    std::fill(unlocked_forward.begin(), unlocked_forward.end(), -1);
    std::fill(unlocked_backward.begin(), unlocked_backward.end(), -1);
    bool progressed = false;
    for (int64_t stage = 0; stage < num_stages; ++stage) {
      ReadyQueue& backward = backward_ready[stage];
      if (!backward.empty()) {
        const int64_t m = backward.items[backward.head++];
        held[stage].erase(held[stage].find(transient(m, stage)));
        memory[stage] = held[stage].empty() ? 0.0 : memory[stage] - act(m, stage);
        orders[stage].push_back(2 * m + 1);
        if (stage > 0) unlocked_backward[stage - 1] = m;
        progressed = true;
      }
      ReadyQueue& forward = forward_ready[stage];
      if (!forward.empty()) {
        const int64_t m = forward.front();
        const bool capped =
            stage == 0 && max_inflight && static_cast<int64_t>(held[0].size()) >= *max_inflight;
        const double worst = held[stage].empty()
                                 ? transient(m, stage)
                                 : std::max(transient(m, stage), *held[stage].rbegin());
        if (!capped && memory[stage] + act(m, stage) + worst <= limit[stage]) {
          forward.head++;
          held[stage].insert(transient(m, stage));
          memory[stage] += act(m, stage);
          orders[stage].push_back(2 * m);
          if (stage + 1 < num_stages) {
            unlocked_forward[stage + 1] = m;
          } else {
            unlocked_backward[stage] = m;
          }
          progressed = true;
        }
      }
    }
    if (!progressed) {
      // Stages past the deepest waiting forward have drained, so that stage holds no
      // activation (and stage 0 then has none in flight): its head can never fit.
      int64_t stage = num_stages - 1;
      while (forward_ready[stage].empty()) --stage;
      const int64_t m = forward_ready[stage].front();
      const std::string working =
          transient(m, stage) > 0.0
              ? " and " + format_bytes(transient(m, stage)) + " bytes of working"
              : "";
      throw std::invalid_argument(
          "micro-batch " + std::to_string(m) + " needs " + format_bytes(act(m, stage)) +
          " bytes of activation" + working + " memory on stage " + std::to_string(stage) +
          ", more than its limit of " + format_bytes(limit[stage]) + " bytes");
    }
    for (int64_t stage = 0; stage < num_stages; ++stage) {
      if (unlocked_forward[stage] >= 0)
        forward_ready[stage].items.push_back(unlocked_forward[stage]);
      if (unlocked_backward[stage] >= 0) {
        backward_ready[stage].items.push_back(unlocked_backward[stage]);
      }
    }
  }
  return orders;
}

// Same checks, order and messages as dynapipe_planner.schedule.ops.check_orders.
void check_orders(const Orders& orders, int64_t num_mb, int64_t num_stages) {
  if (static_cast<int64_t>(orders.size()) != num_stages) {
    throw std::invalid_argument("orders cover " + std::to_string(orders.size()) +
                                " stages, the costs " + std::to_string(num_stages));
  }
  const int64_t num_ops = 2 * num_mb;
  for (int64_t stage = 0; stage < num_stages; ++stage) {
    const std::string where = "stage " + std::to_string(stage) + ": ";
    std::vector<bool> seen(num_ops, false);
    for (const int64_t code : orders[stage]) {
      if (code < 0 || code >= num_ops) {
        throw std::invalid_argument(where + "op code " + std::to_string(code) +
                                    " is not an op of " + std::to_string(num_mb) +
                                    " micro-batches");
      }
      if (seen[code]) throw std::invalid_argument(where + describe_op(code) + " appears twice");
      if (code % 2 && !seen[code - 1]) {
        throw std::invalid_argument(where + describe_op(code) + " comes before its forward");
      }
      seen[code] = true;
    }
    if (static_cast<int64_t>(orders[stage].size()) != num_ops) {
      const int64_t missing = std::find(seen.begin(), seen.end(), false) - seen.begin();
      throw std::invalid_argument(where + describe_op(missing) + " is missing");
    }
  }
}

// Fills start/end, laid out (M, C, 2) row-major; see timeline_reference for the rules.
void simulate_timeline(const Orders& orders, View fwd, View bwd, View act_comm, View grad_comm,
                       int64_t num_mb, int64_t num_stages, double* start, double* end) {
  check_orders(orders, num_mb, num_stages);
  auto at = [num_stages](int64_t m, int64_t stage, int64_t kind) {
    return (m * num_stages + stage) * 2 + kind;
  };
  std::vector<char> done(num_mb * num_stages * 2, 0);
  std::vector<int64_t> position(num_stages, 0);
  std::vector<double> free_at(num_stages, 0.0);
  int64_t remaining = 2 * num_mb * num_stages;
  while (remaining) {
    bool progressed = false;
    for (int64_t stage = 0; stage < num_stages; ++stage) {
      while (position[stage] < 2 * num_mb) {
        const int64_t code = orders[stage][position[stage]];
        const int64_t m = code / 2, kind = code % 2;
        double ready;
        if (kind == 0) {
          if (stage == 0) {
            ready = 0.0;
          } else if (done[at(m, stage - 1, 0)]) {
            ready = end[at(m, stage - 1, 0)] + act_comm(m, stage - 1);
          } else {
            break;
          }
        } else if (stage == num_stages - 1) {
          ready = end[at(m, stage, 0)];  // check_orders put the forward earlier here
        } else if (done[at(m, stage + 1, 1)]) {
          ready = end[at(m, stage + 1, 1)] + grad_comm(m, stage);
        } else {
          break;
        }
        const int64_t i = at(m, stage, kind);
        start[i] = std::max(free_at[stage], ready);
        end[i] = start[i] + (kind ? bwd(m, stage) : fwd(m, stage));
        free_at[stage] = end[i];
        done[i] = 1;
        position[stage] += 1;
        remaining -= 1;
        progressed = true;
      }
    }
    if (!progressed) {
      int64_t stage = 0;
      while (position[stage] == 2 * num_mb) ++stage;
      const int64_t code = orders[stage][position[stage]];
      // Only cross-stage waits can block: a forward waits upstream, a backward downstream.
      const int64_t other = code % 2 ? stage + 1 : stage - 1;
      throw std::invalid_argument("stage " + std::to_string(stage) + ": order deadlocks at " +
                                  describe_op(code) + ", which waits for " + describe_op(code) +
                                  " on stage " + std::to_string(other));
    }
  }
}

// Most bytes each stage uses at once running its orders: stored activations plus the running
// op's working memory, with peak_activation_reference's arithmetic (memory.py).
std::vector<double> peak_memory(const Orders& orders, View act, View transient, int64_t num_mb,
                                int64_t num_stages) {
  check_orders(orders, num_mb, num_stages);
  std::vector<double> peak(num_stages, 0.0);
  for (int64_t stage = 0; stage < num_stages; ++stage) {
    double memory = 0.0;
    int64_t held = 0;
    for (const int64_t code : orders[stage]) {
      const int64_t m = code / 2;
      if (code % 2) {
        peak[stage] = std::max(peak[stage], memory + transient(m, stage));
        held -= 1;
        memory = held ? memory - act(m, stage) : 0.0;
      } else {
        held += 1;
        memory += act(m, stage);
        peak[stage] = std::max(peak[stage], memory + transient(m, stage));
      }
    }
  }
  return peak;
}

// Rows of a (M, cols) view taken in `order`, so the schedule sees micro-batches in injection
// order.
std::vector<double> permuted(View source, const Order& order) {
  std::vector<double> rows(order.size() * source.cols);
  for (size_t i = 0; i < order.size(); ++i) {
    std::copy_n(source.data + order[i] * source.cols, source.cols, rows.data() + i * source.cols);
  }
  return rows;
}

// The adaptive candidates of the schedule search (search.py, `adaptive_candidates_reference`):
// every injection order times every max_inflight option, in that nesting; the first with the
// least makespan wins. A candidate that cannot fit is skipped, the first such error kept.
struct SearchResult {
  int64_t order = -1, option = -1;
  Orders local;
  std::vector<double> start, end;
  double makespan = 0.0;
  std::string first_error;
};

SearchResult adaptive_search(const Orders& injection,
                             const std::vector<std::optional<int64_t>>& options, View act,
                             View transient, const double* limit, View fwd, View bwd, View act_comm,
                             View grad_comm, int64_t num_mb, int64_t num_stages) {
  SearchResult best;
  const size_t size = num_mb * num_stages * 2;
  std::vector<double> start(size), end(size);
  for (size_t k = 0; k < injection.size(); ++k) {
    const Order& order = injection[k];
    const std::vector<double> a = permuted(act, order), t = permuted(transient, order);
    const std::vector<double> f = permuted(fwd, order), b = permuted(bwd, order);
    const std::vector<double> ac = permuted(act_comm, order), gc = permuted(grad_comm, order);
    const View pa{a.data(), num_stages}, pt{t.data(), num_stages};
    const View pf{f.data(), num_stages}, pb{b.data(), num_stages};
    const View pac{ac.data(), num_stages - 1}, pgc{gc.data(), num_stages - 1};
    for (size_t i = 0; i < options.size(); ++i) {
      Orders local;
      try {
        local = adaptive_schedule(pa, pt, limit, num_mb, num_stages, options[i]);
      } catch (const std::invalid_argument& err) {
        if (best.first_error.empty()) best.first_error = err.what();
        continue;
      }
      simulate_timeline(local, pf, pb, pac, pgc, num_mb, num_stages, start.data(), end.data());
      const double makespan = size ? *std::max_element(end.begin(), end.end()) : 0.0;
      if (best.order < 0 || makespan < best.makespan) {
        best.order = static_cast<int64_t>(k);
        best.option = static_cast<int64_t>(i);
        best.local = std::move(local);
        best.start = start;
        best.end = end;
        best.makespan = makespan;
      }
    }
  }
  return best;
}

}  // namespace

void register_schedule(py::module_& m) {
  m.def(
      "one_f_one_b",
      [](int64_t num_stages, int64_t num_mb) {
        if (num_stages < 1 || num_mb < 0) {
          throw std::invalid_argument("1F1B needs at least one stage and M >= 0");
        }
        Orders orders;
        {
          py::gil_scoped_release release;
          orders = one_f_one_b(num_stages, num_mb);
        }
        return orders;
      },
      py::arg("num_stages"), py::arg("num_microbatches"),
      "Non-interleaved 1F1B op codes per stage (2*m forward, 2*m+1 backward).");

  m.def(
      "adaptive_schedule",
      [](const Matrix& activation, const Matrix& limit, std::optional<int64_t> max_inflight,
         const Matrix& transient) {
        const auto [num_mb, num_stages] = pipeline_dims(activation, "activation");
        const View act = view(activation, num_mb, num_stages, "activation");
        const View tra = view(transient, num_mb, num_stages, "transient");
        check_limit(limit, num_stages);
        if (max_inflight && *max_inflight < 1) {
          throw std::invalid_argument("max_inflight must be None or at least 1");
        }
        Orders orders;
        {
          py::gil_scoped_release release;
          orders = adaptive_schedule(act, tra, limit.data(), num_mb, num_stages, max_inflight);
        }
        return orders;
      },
      py::arg("activation"), py::arg("limit"), py::arg("max_inflight"), py::arg("transient"),
      "Memory-aware adaptive schedule (DynaPipe Algorithm 1) with per-op working memory; op "
      "codes per stage.");

  m.def(
      "schedule_timeline",
      [](const Orders& orders, const Matrix& forward, const Matrix& backward,
         const Matrix& act_comm, const Matrix& grad_comm) {
        const auto [num_mb, num_stages] = pipeline_dims(forward, "forward");
        const View fwd = view(forward, num_mb, num_stages, "forward");
        const View bwd = view(backward, num_mb, num_stages, "backward");
        const View act = view(act_comm, num_mb, num_stages - 1, "act_comm");
        const View grad = view(grad_comm, num_mb, num_stages - 1, "grad_comm");
        py::array_t<double> start({num_mb, num_stages, int64_t{2}});
        py::array_t<double> end({num_mb, num_stages, int64_t{2}});
        double* start_data = start.mutable_data();
        double* end_data = end.mutable_data();
        {
          py::gil_scoped_release release;
          simulate_timeline(orders, fwd, bwd, act, grad, num_mb, num_stages, start_data, end_data);
        }
        return std::make_pair(start, end);
      },
      py::arg("orders"), py::arg("forward"), py::arg("backward"), py::arg("act_comm"),
      py::arg("grad_comm"), "Start and end times (M, C, 2) of every op of per-stage orders.");

  m.def(
      "peak_activation",
      [](const Orders& orders, const Matrix& activation, const Matrix& transient) {
        if (activation.ndim() != 2) throw std::invalid_argument("activation must be (M, C)");
        const int64_t num_mb = activation.shape(0), num_stages = activation.shape(1);
        const View act = view(activation, num_mb, num_stages, "activation");
        const View tra = view(transient, num_mb, num_stages, "transient");
        std::vector<double> peak;
        {
          py::gil_scoped_release release;
          peak = peak_memory(orders, act, tra, num_mb, num_stages);
        }
        return py::array_t<double>(static_cast<py::ssize_t>(peak.size()), peak.data());
      },
      py::arg("orders"), py::arg("activation"), py::arg("transient"),
      "Most bytes per stage of stored activations plus the running op's working memory.");

  m.def(
      "adaptive_search",
      [](const Orders& injection, const std::vector<std::optional<int64_t>>& options,
         const Matrix& activation, const Matrix& transient, const Matrix& limit,
         const Matrix& forward, const Matrix& backward, const Matrix& act_comm,
         const Matrix& grad_comm) {
        const auto [num_mb, num_stages] = pipeline_dims(activation, "activation");
        const View act = view(activation, num_mb, num_stages, "activation");
        const View tra = view(transient, num_mb, num_stages, "transient");
        const View fwd = view(forward, num_mb, num_stages, "forward");
        const View bwd = view(backward, num_mb, num_stages, "backward");
        const View ac = view(act_comm, num_mb, num_stages - 1, "act_comm");
        const View gc = view(grad_comm, num_mb, num_stages - 1, "grad_comm");
        check_limit(limit, num_stages);
        for (const Order& order : injection) {
          std::vector<bool> seen(num_mb, false);
          if (static_cast<int64_t>(order.size()) != num_mb) {
            throw std::invalid_argument(
                "injection order is not a permutation of the micro-batches");
          }
          for (const int64_t m : order) {
            if (m < 0 || m >= num_mb || seen[m]) {
              throw std::invalid_argument(
                  "injection order is not a permutation of the micro-batches");
            }
            seen[m] = true;
          }
        }
        for (const auto& option : options) {
          if (option && *option < 1) {
            throw std::invalid_argument("max_inflight must be None or at least 1");
          }
        }
        SearchResult best;
        {
          py::gil_scoped_release release;
          best = adaptive_search(injection, options, act, tra, limit.data(), fwd, bwd, ac, gc,
                                 num_mb, num_stages);
        }
        if (best.order < 0) {
          return py::tuple(
              py::make_tuple(-1, -1, py::none(), py::none(), py::none(), best.first_error));
        }
        const std::vector<py::ssize_t> shape{num_mb, num_stages, 2};
        return py::tuple(py::make_tuple(
            best.order, best.option, best.local, py::array_t<double>(shape, best.start.data()),
            py::array_t<double>(shape, best.end.data()), best.first_error));
      },
      py::arg("injection"), py::arg("options"), py::arg("activation"), py::arg("transient"),
      py::arg("limit"), py::arg("forward"), py::arg("backward"), py::arg("act_comm"),
      py::arg("grad_comm"),
      "The schedule search's adaptive candidates (injection orders x max_inflight options): "
      "(order index, option index, op codes, start, end, first error), or -1 indices when "
      "none fits.");
}
