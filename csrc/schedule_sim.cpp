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
        if (activation.ndim() != 2) throw std::invalid_argument("activation must be (M, C)");
        const int64_t num_mb = activation.shape(0), num_stages = activation.shape(1);
        if (num_stages < 1) throw std::invalid_argument("activation must have at least one stage");
        const View act = view(activation, num_mb, num_stages, "activation");
        const View tra = view(transient, num_mb, num_stages, "transient");
        if (limit.ndim() != 1 || limit.shape(0) != num_stages) {
          throw std::invalid_argument("limit: shape does not match the pipeline");
        }
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
        if (forward.ndim() != 2) throw std::invalid_argument("forward must be (M, C)");
        const int64_t num_mb = forward.shape(0), num_stages = forward.shape(1);
        if (num_stages < 1) throw std::invalid_argument("forward must have at least one stage");
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
}
