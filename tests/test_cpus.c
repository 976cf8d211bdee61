/* Unit test for cpus.c: the cgroup CPU quota parsers on literal texts and on fixture trees in
 * tests/data/cgroup (v2 flat and nested, v1 under cpu/ and cpu,cpuacct/, no limit, bad files),
 * and fitm_cpus_available's bounds. The tree root is argv[1]. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "server/cpus.h"

static void test_parse(void)
{
    double c = -1;
    fitm_err err = {{0}};
    CHECK(fitm_cpus_parse_v2("150000 100000\n", &c, &err) == FITM_OK && c == 1.5);
    CHECK(fitm_cpus_parse_v2("max 100000", &c, &err) == FITM_OK && c == 0);
    CHECK(fitm_cpus_parse_v2("max", &c, &err) == FITM_ERR_FORMAT && strstr(err.msg, "cpu.max"));
    CHECK(fitm_cpus_parse_v2("1 2 3", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v2("-5 100000", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v2("100000 0", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v2("", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v1("50000\n", "100000\n", &c, &err) == FITM_OK && c == 0.5);
    CHECK(fitm_cpus_parse_v1("-1\n", "100000\n", &c, &err) == FITM_OK && c == 0);
    CHECK(fitm_cpus_parse_v1("-2", "100000", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v1("x", "100000", &c, &err) == FITM_ERR_FORMAT);
    CHECK(fitm_cpus_parse_v1("1000", "", &c, &err) == FITM_ERR_FORMAT);
}

static double quota(const char *root, const char *tree, const char *self)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root, tree);
    return fitm_cpus_cgroup_quota(path, self);
}

static void test_trees(const char *root)
{
    CHECK(quota(root, "v2-half", "/") == 0.5);
    CHECK(quota(root, "v2-half", "") == 0.5);
    CHECK(quota(root, "v2-unlimited", "/") == 0);
    /* nested: the pod's 1.5 under the 4 of its parent; the parent alone limits a sibling */
    CHECK(quota(root, "v2-nested", "/kubepods/pod1") == 1.5);
    CHECK(quota(root, "v2-nested", "/kubepods/pod1/") == 1.5);
    CHECK(quota(root, "v2-nested", "/kubepods/pod2") == 4);
    CHECK(quota(root, "v2-bad", "/") == 0);
    CHECK(quota(root, "v1-two", "/") == 2);
    CHECK(quota(root, "v1-unlimited", "/") == 0);
    CHECK(quota(root, "v1-combined", "/") == 0.5);
    CHECK(quota(root, "absent", "/") == 0);
}

static void test_available(void)
{
    int aff = 0;
    double q = -1;
    int n = fitm_cpus_available(&aff, &q);
    CHECK(aff >= 1 && q >= 0 && n >= 1 && n <= aff);
    CHECK(q == 0 || n <= (int)ceil(q));
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: test_cpus TESTDATA/cgroup\n");
        return 2;
    }
    test_parse();
    test_trees(argv[1]);
    test_available();
    if (failures) {
        fprintf(stderr, "test_cpus: %d of %d checks failed\n", failures, n_checks);
        return 1;
    }
    printf("test_cpus: ok (%d checks)\n", n_checks);
    return 0;
}
