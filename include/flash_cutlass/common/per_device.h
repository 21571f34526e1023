// A value per device that host code computes once; plain C++ (no kernel launch), for the host
// file and the launch headers alike.
#pragma once

#include <atomic>
#include <climits>

namespace flash_cutlass {

// One int per device, computed on a device's first use and kept: what a launch would otherwise ask
// the driver on every call (a kernel's shared memory attribute, its occupancy). A function-local
// static per value; compute() runs with the device current and returns the value (>= 0), or a
// negative number for a failure, which is returned but not kept. Two threads may both compute a
// value first: the computations are idempotent. Devices past kMaxDevices compute on every call.
class PerDeviceValue {
 public:
  PerDeviceValue() {
    for (auto& value : values_) value.store(kUnknown, std::memory_order_relaxed);
  }

  template <class Compute>
  int get(int device, Compute&& compute) {
    if (device < 0 || device >= kMaxDevices) return compute();
    int value = values_[device].load(std::memory_order_acquire);
    if (value != kUnknown) return value;
    value = compute();
    if (value >= 0) values_[device].store(value, std::memory_order_release);
    return value;
  }

 private:
  static constexpr int kMaxDevices = 64;
  static constexpr int kUnknown = INT_MIN;
  std::atomic<int> values_[kMaxDevices];
};

}  // namespace flash_cutlass
