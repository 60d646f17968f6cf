from rest_framework.pagination import PageNumberPagination


class MeridianPagination(PageNumberPagination):
    """?page=N&page_size=M (at most 500), so a 100k-row list is never one response."""

    page_size_query_param = "page_size"
    max_page_size = 500


def paginate(view, queryset, serializer_class, *, context=None):
    """Returns the paginated response of one page of `queryset` serialized by `serializer_class`."""
    paginator = MeridianPagination()
    page = paginator.paginate_queryset(queryset, view.request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True, context=context or {}).data)
