/*
 * /init of bench/precopy_probe.py's guest: one process that rewrites the first word of PAGES
 * pages in a tight loop, each sweep writing the sweep's number, and checks before each write
 * that the page still holds the previous sweep's number. A restored guest whose RAM image lost
 * a write shows it at once: "MEMCHECK lost page I: has OLD, expected NEW".
 *
 * Why a tight loop over few pages: the loss it looks for (QEMU < 9.0 under TCG, see the
 * script) needs a page to keep its vCPU TLB entry across a migration bitmap sync; a small
 * working set and no context switches keep the entries cached.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <time.h>
#include <unistd.h>

#define PAGES 32
#define WORDS_PER_PAGE 512

int main(void)
{
	/* PID 1 of an initramfs with nothing else in it: the console first. */
	mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
	int fd = open("/dev/ttyS0", O_WRONLY);
	if (fd >= 0) {
		dup2(fd, 1);
		dup2(fd, 2);
	}
	setvbuf(stdout, NULL, _IONBF, 0);

	volatile uint64_t *m = aligned_alloc(4096, (size_t)PAGES * 4096);
	if (!m) {
		printf("MEMCHECK no memory\n");
		for (;;)
			pause();
	}
	for (size_t i = 0; i < PAGES; i++)
		m[i * WORDS_PER_PAGE] = 0;
	printf("MEMCHECK start pages=%d\n", PAGES);

	uint64_t sweep = 0, lost = 0;
	time_t last = 0;
	for (;;) {
		sweep++;
		for (size_t i = 0; i < PAGES; i++) {
			uint64_t v = m[i * WORDS_PER_PAGE];
			if (v != sweep - 1) {
				if (lost < 20)
					printf("MEMCHECK lost page %zu: has %llu, expected %llu\n", i,
					       (unsigned long long)v, (unsigned long long)(sweep - 1));
				lost++;
			}
			m[i * WORDS_PER_PAGE] = sweep;
		}
		/* A line a second at most, so the check itself stays syscall-free. */
		if ((sweep & 4095) == 0) {
			time_t t = time(NULL);
			if (t != last) {
				last = t;
				printf("MEMCHECK sweep=%llu lost=%llu\n", (unsigned long long)sweep,
				       (unsigned long long)lost);
			}
		}
	}
}
