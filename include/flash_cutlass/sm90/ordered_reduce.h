// Reductions into global memory in a fixed order across CTAs, for the deterministic Hopper backward:
// the CTAs that add to one accumulator tile take turns, kept in an int32 counter in global memory
// (zeroed before the kernel). A CTA waits until the counter equals its place in the order, adds
// with TMA's reduce-add, waits for that reduction to complete (not only for its shared-memory
// source to be read), and passes the turn on by incrementing the counter. The CTAs of earlier
// turns are never waiting on later ones (the grid launches them first and each walks its tiles in
// one direction), so the chain cannot deadlock.
#pragma once

namespace flash_cutlass::sm90 {

// Polls until *turn == place; the acquire orders the reductions of earlier turns, then the proxy
// fence the TMA unit's (async proxy) reduction, before this thread's next one. A turn that never
// comes (a place counted wrong, a CTA the GPU never ran) would hang the device: past about a
// minute of polling the kernel traps instead, which the host reports as a launch failure.
__device__ __forceinline__ void wait_for_turn(const int* turn, int place) {
  constexpr unsigned kMaxPolls = 1u << 26;  // of at least 1 us each (the load and the back-off)
  for (unsigned polls = 0;; ++polls) {
    int current;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(current) : "l"(turn) : "memory");
    if (current == place) break;
    if (polls == kMaxPolls) __trap();
    __nanosleep(128);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// After this thread's committed bulk reductions: waits for them to complete in global memory, then
// releases the turn to the next CTA.
__device__ __forceinline__ void pass_turn_after_reductions(int* turn) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(turn) : "memory");
}

}  // namespace flash_cutlass::sm90
