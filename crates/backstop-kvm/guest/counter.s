# backstop-kvm's built-in guest program ("counter"): 32-bit protected mode, flat segments, no
# paging, interrupts off. The VMM enters it at CODE_GPA with the parameter block filled in.
# Assembled by hand into src/guest.rs (the test `guest_bytes_match_source` re-assembles this file
# with GNU as, when present, and compares):
#   as --32 counter.s -o counter.o && objcopy -O binary counter.o counter.bin
#
# Each tick: tick += 1; dirty `pages_per_tick` pages of the dirty area, cycling through
# `span_pages` pages from `dirty_base` (page[0] = tick, page[1] = page index); print
# "T<tick> W<writes>\n" (8 hex digits each) on the serial port; send the tick to the heartbeat
# port; after `max_ticks` ticks (0 = never) write the exit port; spin `delay_loops` times.
.code32
.set PARAMS, 0x1000
.set COUNTERS, 0x2000
.set SERIAL, 0x3f8
.set HEARTBEAT, 0x510
.set EXIT, 0x511
.org 0
start:
  mov $0x7000, %esp
tick:
  incl COUNTERS+0
  mov PARAMS+4, %ecx
  test %ecx, %ecx
  jz report
dirty:
  mov COUNTERS+4, %eax
  mov %eax, %ebx
  shl $12, %ebx
  add PARAMS+8, %ebx
  mov COUNTERS+0, %edx
  mov %edx, (%ebx)
  mov %eax, 4(%ebx)
  inc %eax
  cmp PARAMS+12, %eax
  jb 1f
  xor %eax, %eax
1:
  mov %eax, COUNTERS+4
  incl COUNTERS+8
  dec %ecx
  jnz dirty
report:
  mov $SERIAL, %dx
  mov $'T', %al
  out %al, %dx
  mov COUNTERS+0, %ebx
  call hex32
  mov $' ', %al
  out %al, %dx
  mov $'W', %al
  out %al, %dx
  mov COUNTERS+8, %ebx
  call hex32
  mov $'\n', %al
  out %al, %dx
  mov $HEARTBEAT, %dx
  mov COUNTERS+0, %eax
  out %eax, %dx
  mov PARAMS+16, %eax
  test %eax, %eax
  jz delay
  cmp COUNTERS+0, %eax
  ja delay
  mov $EXIT, %dx
  xor %eax, %eax
  out %al, %dx
  jmp tick
delay:
  mov PARAMS+20, %ecx
  test %ecx, %ecx
  jz tick
2:
  dec %ecx
  jnz 2b
  jmp tick
hex32:
  mov $8, %esi
3:
  rol $4, %ebx
  mov %bl, %al
  and $0xf, %al
  cmp $10, %al
  jb 4f
  add $0x27, %al
4:
  add $0x30, %al
  out %al, %dx
  dec %esi
  jnz 3b
  ret
