/* replay: runs every file in the given directories (or the given files) through
 * LLVMFuzzerTestOneInput once, so the fuzz corpus is a regression test under any compiler and
 * sanitizer, without libFuzzer. Exit status 0 when every input ran; 1 when an input could not
 * be read or nothing was found; a crash in the target ends the process as usual. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads the whole file into an exact-size buffer (so overreads are caught by ASan). */
static int run_file(const char *path)
{
    int rc = 1;
    uint8_t *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        goto done;
    }
    if (fseek(f, 0, SEEK_END) != 0)
        goto done;
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0)
        goto done;
    buf = malloc(n ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        goto done;
    }
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    rc = 0;
done:
    if (f)
        fclose(f);
    free(buf);
    return rc;
}

int main(int argc, char **argv)
{
    int n_run = 0, n_bad = 0;
    for (int a = 1; a < argc; a++) {
        struct stat sb;
        if (stat(argv[a], &sb) != 0) {
            fprintf(stderr, "replay: %s does not exist\n", argv[a]);
            n_bad++;
            continue;
        }
        if (!S_ISDIR(sb.st_mode)) {
            n_bad += run_file(argv[a]);
            n_run++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        if (!d) {
            fprintf(stderr, "replay: cannot list %s\n", argv[a]);
            n_bad++;
            continue;
        }
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.')
                continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[a], de->d_name);
            if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
                continue;
            n_bad += run_file(path);
            n_run++;
        }
        closedir(d);
    }
    printf("replay: %d inputs run, %d unreadable\n", n_run, n_bad);
    return (n_bad || n_run == 0) ? 1 : 0;
}
