// Micro-batch construction by dynamic programming over ordered samples.
//
// DynaPipe (seed dynapipe.txt) section 4, Eq. 2 with the t_max enumeration: for a threshold T on
// the longest micro-batch, f(n; T) = min_i f(i; T) + t(M[i+1..n]) over contiguous ranges whose
// time is <= T and whose memory fits; the answer minimises (c-1) * max t + f(N; T) / |D|.
//
// Speed comes from three facts. Range costs only grow as a range extends to the left (costs are
// monotone in samples and padded length), so each scan stops at the first range over T and that
// range's cost is the next threshold worth trying. A lower bound on f (each sample's cheapest
// per-sample share at its own length) stops the enumeration once (c-1) * T alone cannot win. Range
// costs are computed lazily, only as far as the thresholds reach. The Python reference
// (dynapipe_planner/microbatch/reference_dp.py) mirrors this file operation for operation.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Cell {
  int k;
  double w;
};

// Cell of x on an increasing grid; false beyond the last point (same rule as cost/table.py).
bool locate(const std::vector<double>& g, double x, Cell* cell) {
  const int n = static_cast<int>(g.size());
  if (x <= g[0]) {
    *cell = {0, 0.0};
    return true;
  }
  if (x > g[n - 1]) return false;
  const int k = static_cast<int>(std::upper_bound(g.begin(), g.end(), x) - g.begin()) - 1;
  if (k >= n - 1) {
    *cell = {n - 1, 0.0};
    return true;
  }
  *cell = {k, (x - g[k]) / (g[k + 1] - g[k])};
  return true;
}

double lerp(double a, double b, double w) {
  if (w == 0.0) return a;
  if (std::isinf(a) || std::isinf(b)) return kInf;
  return a + w * (b - a);
}

// A (b, s, t) table, trilinearly interpolated in the order t, then s, then b.
struct Table {
  const double* v;
  int ns, nt;
  double at(int ib, int is, int it) const {
    return v[(static_cast<int64_t>(ib) * ns + is) * nt + it];
  }
  double along_t(int ib, int is, const Cell& ct) const {
    const double v0 = at(ib, is, ct.k);
    return ct.w == 0.0 ? v0 : lerp(v0, at(ib, is, ct.k + 1), ct.w);
  }
  double along_s(int ib, const Cell& cs, const Cell& ct) const {
    const double v0 = along_t(ib, cs.k, ct);
    return cs.w == 0.0 ? v0 : lerp(v0, along_t(ib, cs.k + 1, ct), cs.w);
  }
  double interp(const Cell& cb, const Cell& cs, const Cell& ct) const {
    const double v0 = along_s(cb.k, cs, ct);
    return cb.w == 0.0 ? v0 : lerp(v0, along_s(cb.k + 1, cs, ct), cb.w);
  }
};

struct Problem {
  std::vector<int64_t> src, tgt;  // per ordered sample; tgt all zero for decoder-only models
  std::vector<double> bg, sg, tg;
  Table time, mem;
};

// Time of micro-batch [i..j] (inclusive), or +inf when it does not fit in memory or the grid.
double range_cost(const Problem& p, int64_t b, int64_t s, int64_t t) {
  Cell cb, cs, ct;
  if (!locate(p.bg, static_cast<double>(b), &cb) || !locate(p.sg, static_cast<double>(s), &cs) ||
      !locate(p.tg, static_cast<double>(t), &ct))
    return kInf;
  if (p.mem.interp(cb, cs, ct) > 1.0) return kInf;
  return p.time.interp(cb, cs, ct);
}

// Costs of the ranges ending at one sample, grown leftwards on demand. Growing a range adds one
// sample and can only raise its padded lengths, so each grid cell moves forward from the last
// one instead of being searched again (the cells equal what `locate` returns).
struct Band {
  std::vector<double> cost;  // cost[k]: range [j-k .. j]
  int64_t smax = 0, tmax = 0;
  Cell cb{0, 0.0}, cs{0, 0.0}, ct{0, 0.0};
  bool closed = false;  // the next range is infeasible (memory, grid or start of the batch)
};

// Moves `cell` forward to x (never backward); false beyond the grid. Same result as locate().
bool advance(const std::vector<double>& g, double x, Cell* cell) {
  const int n = static_cast<int>(g.size());
  if (x > g[n - 1]) return false;
  int k = cell->k;
  while (k + 1 < n && g[k + 1] <= x) ++k;
  cell->k = k;
  cell->w = (x <= g[0] || k >= n - 1) ? 0.0 : (x - g[k]) / (g[k + 1] - g[k]);
  return true;
}

void extend(const Problem& p, int64_t j, Band* band) {
  const int64_t k = static_cast<int64_t>(band->cost.size());
  const int64_t i = j - k;
  if (i < 0) {
    band->closed = true;
    return;
  }
  band->smax = std::max(band->smax, p.src[i]);
  band->tmax = std::max(band->tmax, p.tgt[i]);
  if (!advance(p.bg, static_cast<double>(k + 1), &band->cb) ||
      !advance(p.sg, static_cast<double>(band->smax), &band->cs) ||
      !advance(p.tg, static_cast<double>(band->tmax), &band->ct) ||
      p.mem.interp(band->cb, band->cs, band->ct) > 1.0) {
    band->closed = true;
    return;
  }
  band->cost.push_back(p.time.interp(band->cb, band->cs, band->ct));
}

// Largest feasible micro-batch size at one sample's own lengths (memory and grid), by bisection.
int64_t max_feasible_size(const Problem& p, int64_t s, int64_t t, int64_t limit) {
  int64_t lo = 1, hi = limit;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (std::isinf(range_cost(p, mid, s, t)))
      hi = mid - 1;
    else
      lo = mid;
  }
  return lo;
}

// Lower bound on f(N; T) for every T: each sample pays at least the cheapest per-sample share of
// a micro-batch padded to its own lengths. Between b-grid points t(b)/b is monotone, so only the
// grid points and the largest feasible size need checking.
double lower_bound_total(const Problem& p) {
  const int64_t n = static_cast<int64_t>(p.src.size());
  const int64_t bmax_grid = static_cast<int64_t>(p.bg.back());
  double total = 0.0, share = 0.0;
  int64_t last_s = -1, last_t = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (p.src[j] != last_s || p.tgt[j] != last_t) {
      last_s = p.src[j];
      last_t = p.tgt[j];
      const int64_t bmax = max_feasible_size(p, last_s, last_t, std::min(n, bmax_grid));
      share = range_cost(p, bmax, last_s, last_t) / static_cast<double>(bmax);
      for (double gb : p.bg) {
        const int64_t b = static_cast<int64_t>(gb);
        if (b > bmax) break;
        share = std::min(share, range_cost(p, b, last_s, last_t) / static_cast<double>(b));
      }
    }
    total += share;
  }
  return total;
}

struct Pass {
  double total = kInf;        // f(N; T)
  double max_cost = 0.0;      // longest micro-batch of the partition found
  double next = kInf;         // smallest range cost above T (the next threshold worth trying)
  std::vector<int64_t> ends;  // exclusive end of each micro-batch
};

Pass run_pass(const Problem& p, std::vector<Band>* bands, double threshold, std::vector<double>* f,
              std::vector<int64_t>* take) {
  const int64_t n = static_cast<int64_t>(p.src.size());
  Pass out;
  (*f)[0] = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    Band& band = (*bands)[j];
    while (!band.closed && band.cost.back() <= threshold) extend(p, j, &band);
    // Band costs never decrease, so the ranges within the threshold are a prefix.
    const int64_t cut =
        std::upper_bound(band.cost.begin(), band.cost.end(), threshold) - band.cost.begin();
    if (cut < static_cast<int64_t>(band.cost.size())) out.next = std::min(out.next, band.cost[cut]);
    const double* cost = band.cost.data();
    const double* fj = f->data() + j;  // fj[-k] == f[j - k]
    double best = kInf;
    for (int64_t k = 0; k < cut; ++k) best = std::min(best, fj[-k] + cost[k]);
    int64_t best_k = -1;
    for (int64_t k = 0; k < cut && best < kInf; ++k) {
      if (fj[-k] + cost[k] == best) {
        best_k = k;
        break;
      }
    }
    (*f)[j + 1] = best;
    (*take)[j + 1] = best_k;
  }
  out.total = (*f)[n];
  if (std::isinf(out.total)) return out;
  for (int64_t end = n; end > 0; end -= (*take)[end] + 1) {
    out.ends.push_back(end);
    out.max_cost = std::max(out.max_cost, (*bands)[end - 1].cost[(*take)[end]]);
  }
  std::reverse(out.ends.begin(), out.ends.end());
  return out;
}

std::vector<double> to_vector(
    const py::array_t<double, py::array::c_style | py::array::forcecast>& a) {
  return std::vector<double>(a.data(), a.data() + a.size());
}

py::dict microbatch_dp(py::array_t<int64_t, py::array::c_style | py::array::forcecast> src,
                       py::array_t<int64_t, py::array::c_style | py::array::forcecast> tgt,
                       py::array_t<double, py::array::c_style | py::array::forcecast> b_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> s_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> t_grid,
                       py::array_t<double, py::array::c_style | py::array::forcecast> time_table,
                       py::array_t<double, py::array::c_style | py::array::forcecast> mem_table,
                       int num_stages, int num_replicas, double bucket_abs, double bucket_rel,
                       double time_budget_s) {
  Problem p;
  const int64_t n = src.size();
  p.src.assign(src.data(), src.data() + n);
  p.tgt.assign(n, 0);
  if (tgt.size() == n) p.tgt.assign(tgt.data(), tgt.data() + n);
  p.bg = to_vector(b_grid);
  p.sg = to_vector(s_grid);
  p.tg = to_vector(t_grid);
  const int ns = static_cast<int>(p.sg.size()), nt = static_cast<int>(p.tg.size());
  const int64_t cells = static_cast<int64_t>(p.bg.size()) * ns * nt;
  if (time_table.size() != cells || mem_table.size() != cells || n == 0)
    throw std::invalid_argument("microbatch_dp: table sizes do not match the grids, or no samples");
  p.time = {time_table.data(), ns, nt};
  p.mem = {mem_table.data(), ns, nt};

  py::dict result;
  int64_t infeasible = -1;
  double objective = kInf, passes = 0;
  bool exhausted = false;
  Pass best;
  {
    py::gil_scoped_release release;
    const auto start = std::chrono::steady_clock::now();
    const double bubble = num_stages - 1;
    const double replicas = num_replicas;
    std::vector<Band> bands(n);
    double threshold = 0.0;
    for (int64_t j = 0; j < n && infeasible < 0; ++j) {
      extend(p, j, &bands[j]);
      if (bands[j].cost.empty())
        infeasible = j;
      else
        threshold = std::max(threshold, bands[j].cost[0]);
    }
    if (infeasible < 0) {
      const double bound = lower_bound_total(p) / replicas;
      // (c-1) * (slowest single sample) + bound is at most the optimum, so spacing thresholds
      // by bucket_rel of it keeps the answer within bucket_rel of the optimum.
      const double width =
          std::max(bucket_abs, bucket_rel * (bubble * threshold + bound) / std::max(1.0, bubble));
      if (num_stages == 1) threshold = kInf;  // no bubble term: the loosest threshold is optimal
      std::vector<double> f(n + 1);
      std::vector<int64_t> take(n + 1);
      while (true) {
        Pass pass = run_pass(p, &bands, threshold, &f, &take);
        passes += 1;
        const double obj = bubble * pass.max_cost + pass.total / replicas;
        if (obj < objective) {
          objective = obj;
          best = std::move(pass);
        }
        if (std::isinf(pass.next) || bubble * pass.next + bound >= objective) break;
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (time_budget_s > 0 && elapsed > time_budget_s) {
          exhausted = true;
          break;
        }
        threshold = std::max(pass.next, threshold + width);
      }
    }
  }
  result["infeasible_position"] = infeasible;
  result["ends"] = best.ends;
  result["objective"] = objective;
  result["max_time"] = best.max_cost;
  result["sum_time"] = best.total;
  result["passes"] = passes;
  result["budget_exhausted"] = exhausted;
  return result;
}

}  // namespace

void register_microbatch_dp(py::module_& m) {
  m.def("microbatch_dp", &microbatch_dp, py::arg("src"), py::arg("tgt"), py::arg("b_grid"),
        py::arg("s_grid"), py::arg("t_grid"), py::arg("time_table"), py::arg("mem_table"),
        py::arg("num_stages"), py::arg("num_replicas"), py::arg("bucket_abs"),
        py::arg("bucket_rel"), py::arg("time_budget_s"),
        "DynaPipe Eq. 2 DP over ordered samples; see csrc/microbatch_dp.cpp.");
}
